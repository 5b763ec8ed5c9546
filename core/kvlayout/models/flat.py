"""The parts every architecture shares on kvlayout's flat step.

A step is one forward over a flat token axis (batch size 1) whose tokens may
belong to different sequences at unrelated positions: every token brings its
own position, and attention goes through the cache's
`update_and_fetch(layer, positions, k, v)` and `kvlayout.mlx.attend`. That is
all that differs from mlx-lm's model files, so it lives here once:
`RopeAt` applies any RoPE module at per-token positions, `attend_through`
runs one layer's attention through the cache, `PreNormBlock` is the residual
block most families share, and `DecoderModel` is the embed / layers / norm /
head loop. A family module (`llama`, `qwen3`, ...) supplies only its
attention and MLP and what it does differently.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from kvlayout.errors import ShapeError
from kvlayout.mlx import attend
from kvlayout.positions import StepPositions, step_positions


class RopeAt(nn.Module):
    """A RoPE module (`nn.RoPE`, or one of mlx-lm's scaled variants: anything called as
    `rope(x, offset=...)` that rotates with mx.fast.rope) applied at explicit per-token positions.

    mx.fast.rope takes one offset per batch entry: the step's tokens go on the batch axis
    (`[T, H, 1, D]`) with their positions as the offsets, the kernel mlx-lm runs, so each
    token's rotation is bit-identical to mlx-lm's at that position. Positions given as an int
    (a step whose positions run consecutively from there: one sequence's, usually) are mlx-lm's call as it is.
    """

    def __init__(self, rope: nn.Module):
        super().__init__()
        self.rope = rope
        self.freeze()  # precomputed frequencies, never weights of the checkpoint

    def __call__(self, x: mx.array, positions: int | mx.array) -> mx.array:
        if isinstance(positions, int) or x.shape[2] == 1:
            # Consecutive positions from an int (mlx-lm's own call), or one token: [1, H, 1, D]
            # already has it on the batch axis.
            return self.rope(x, offset=positions)
        xt = x.transpose(2, 1, 0, 3)  # [1, H, T, D] -> [T, H, 1, D]
        return self.rope(xt, offset=positions).transpose(2, 1, 0, 3)  # [1, H, T, D]


def heads(x: mx.array, n_heads: int, norm: nn.Module | None = None) -> mx.array:
    """`[1, T, n * D]` projections as `[1, n, T, D]` heads, each head normed by `norm` first when given.

    The norm runs before the transpose, on row-contiguous heads, as mlx-lm's model files order it:
    normed after it, a decode step of Qwen3's shape ran 12% slower on the CPU."""
    _, t, _ = x.shape
    x = x.reshape(1, t, n_heads, -1)  # [1, T, n, D]
    if norm is not None:
        x = norm(x)
    return x.transpose(0, 2, 1, 3)


def attend_through(cache: Any, layer: int, pos_host: StepPositions, q: mx.array, k: mx.array, v: mx.array,
                   scale: float, sinks: mx.array | None = None) -> mx.array:
    """One layer's attention through the cache: K/V `[1, H_kv, T, D]` stored where the layout says,
    `q` `[1, H_q, T, D]` attending what the step may see; the heads' outputs as `[1, T, H_q * D]`.
    `pos_host`: the forward's positions, one object for every layer (checked once)."""
    spec = cache.update_and_fetch(layer, pos_host, k, v)
    o = attend(q, spec, scale) if sinks is None else attend(q, spec, scale, sinks=sinks)  # [1, H_q, T, D]
    _, _, t, _ = o.shape
    return o.transpose(0, 2, 1, 3).reshape(1, t, -1)


class Attention(nn.Module):
    """Separate q/k/v/o projections (HF's names), optional per-head q/k norms, RoPE at per-token
    positions, attention through the cache: Llama's, Qwen3's, Gemma 3's and gpt-oss's layer, which
    differ only in what the arguments say.

    `rope`: a RopeAt (or anything called as rope(x, positions)); `scale`: the softmax scale;
    `bias`: q/k/v biases, `o_bias`: o_proj's (default: as `bias`); `norm`: a norm class made per
    head (`norm(head_dim, eps=...)`) for q_norm / k_norm, None for none; `sinks`: a learned sink
    logit per query head (gpt-oss), a checkpoint tensor.
    """

    def __init__(self, args: Any, layer: int, rope: Any, scale: float, bias: bool = False,
                 o_bias: bool | None = None, norm: Callable[..., nn.Module] | None = None, sinks: bool = False):
        super().__init__()
        self.layer = layer
        self.n_heads, self.n_kv_heads = args.num_attention_heads, args.num_key_value_heads
        self.scale = scale
        dim, hd = args.hidden_size, args.head_dim
        if sinks:
            self.sinks = mx.zeros((self.n_heads,))  # [H_q]
        self.q_proj = nn.Linear(dim, self.n_heads * hd, bias=bias)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * hd, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * hd, dim, bias=bias if o_bias is None else o_bias)
        if norm is not None:
            self.q_norm = norm(hd, eps=args.rms_norm_eps)
            self.k_norm = norm(hd, eps=args.rms_norm_eps)
        self.rope = rope

    def __call__(self, x: mx.array, positions: int | mx.array, pos_host: StepPositions, cache: Any) -> mx.array:
        q = heads(self.q_proj(x), self.n_heads, self.get("q_norm"))  # [1, Hq, T, D], each head normed if so
        k = heads(self.k_proj(x), self.n_kv_heads, self.get("k_norm"))  # [1, Hkv, T, D]
        v = heads(self.v_proj(x), self.n_kv_heads)  # [1, Hkv, T, D]
        q, k = self.rope(q, positions), self.rope(k, positions)
        # The layout decides where K/V go and what this step may see.
        o = attend_through(cache, self.layer, pos_host, q, k, v, self.scale, self.get("sinks"))  # [1, T, Hq * D]
        return self.o_proj(o)  # [1, T, hidden]


class PreNormBlock(nn.Module):
    """x + attn(norm(x)), then h + mlp(norm(h)): the block of Llama, Qwen, Phi-3 and gpt-oss, under
    HF's names (`self_attn`, `mlp`, `input_layernorm`, `post_attention_layernorm`)."""

    def __init__(self, self_attn: nn.Module, mlp: nn.Module, hidden: int, eps: float):
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = nn.RMSNorm(hidden, eps=eps)
        self.post_attention_layernorm = nn.RMSNorm(hidden, eps=eps)

    def __call__(self, x, positions, pos_host, cache):
        h = x + self.self_attn(self.input_layernorm(x), positions, pos_host, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class Backbone(nn.Module):
    """HF's `model.` prefix: embeddings, layers, final norm."""

    def __init__(self, vocab: int, hidden: int, layers: list, norm: nn.Module):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab, hidden)
        self.layers = layers
        self.norm = norm


class DecoderModel(nn.Module):
    """Embeddings, the layers over one flat step, the final norm and the head (tied to the embedding
    or `lm_head`). `embed_scale`, when given, scales the embeddings as that family does (Gemma)."""

    def __init__(self, args: Any, layers: list, norm: nn.Module,
                 embed_scale: Callable[[mx.array], mx.array] | None = None):
        super().__init__()
        self.args = args
        self.model = Backbone(args.vocab_size, args.hidden_size, layers, norm)
        self.embed_scale = embed_scale
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    @property
    def dtype(self) -> mx.Dtype:
        """The compute dtype. The final norm's: it is never quantized, while a
        quantized embedding's weight is packed uint32."""
        return self.model.norm.weight.dtype

    def __call__(
        self,
        tokens: Sequence[int],
        positions: Sequence[int],
        cache: Any,
        rows: Sequence[int] | None = None,
    ) -> mx.array:
        """Logits `[R, V]` of the step's tokens at `rows` (all tokens when None).

        `tokens` and `positions` run over one flat token axis; `cache` is any
        layout's op face and was told (declare_step) whose tokens these are.
        Only the rows a sampler needs go through the LM head.
        """
        # Checked once for every layer's cache (kvlayout.positions): a list or array would be converted
        # and checked again by the layout at each layer, host time a small model's step cannot hide.
        pos_host = step_positions(positions)  # [T]
        if pos_host.size != len(tokens):
            raise ShapeError(f"{len(tokens)} token(s) but {pos_host.size} position(s): expected one position per token")
        # Consecutive positions (one sequence's, usually) rotate from an int offset, as mlx-lm's step does: no array
        # to make, no transposes (RoPE); any other step's tokens each bring their position.
        pos = pos_host.first if pos_host.consecutive else mx.array(pos_host.host, dtype=mx.int32)  # [T]
        # Tokens drawn on the device (engines.ahead) are fed as they are: a cast is one more node a step.
        ids = tokens if isinstance(tokens, mx.array) and mx.issubdtype(tokens.dtype, mx.integer) else mx.array(
            tokens, dtype=mx.int32)
        h = self.model.embed_tokens(ids)[None]  # [1, T, hidden]
        if self.embed_scale is not None:
            h = self.embed_scale(h)
        for layer in self.model.layers:
            h = layer(h, pos, pos_host, cache)
        h = h.squeeze(0)  # [T, hidden] (a reshape; h[0] would gather)
        if rows is not None and not (len(rows) == len(tokens) == 1):  # one token: its row is h
            h = h[mx.array(rows, dtype=mx.int32)]  # [R, hidden]
        h = self.model.norm(h)
        if self.args.tie_word_embeddings:
            # The embedding as the head: a plain matmul, or a quantized one when it is packed.
            return self.model.embed_tokens.as_linear(h)  # [R, V]
        return self.lm_head(h)  # [R, V]
