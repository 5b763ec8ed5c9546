"""A Llama-family decoder (Llama, Mistral, Qwen2) whose K/V live in a kvlayout cache.

Numerically the Hugging Face definition, as mlx-lm writes it: RMSNorm, rotate-half
rotary embeddings, grouped-query attention, SwiGLU MLP, tied or untied head,
q/k/v biases for Qwen2. Parameter names match the HF checkpoint names
(`model.layers.0.self_attn.q_proj.weight`), so a safetensors file loads as is.

What differs from mlx-lm is the step: one forward carries a flat token axis
(batch size 1) whose tokens may belong to different sequences at unrelated
positions, so every token brings its own position, and attention goes through
`cache.update_and_fetch(layer, positions, k, v)` and `kvlayout.mlx.attend`.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import mlx.core as mx
import mlx.nn as nn
import numpy as np

from kvlayout.config import LayerConfig, LayerPolicy
from kvlayout.errors import ConfigError, ShapeError
from kvlayout.mlx import attend
from kvlayout.models import config_values as values

MODEL_TYPES = ("llama", "mistral", "qwen2")


@attrs.frozen
class ModelArgs:
    """The fields of an HF `config.json` this decoder uses, with HF's defaults."""

    model_type: str
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    # Per layer: 0 for full attention, else the sliding window (a ring layer).
    windows: tuple[int, ...] = ()
    eos_token_id: tuple[int, ...] = ()

    @classmethod
    def from_hf(cls, cfg: Mapping[str, Any], source: str = "config.json") -> ModelArgs:
        """Read an HF config dict; ConfigError names the file, the key and what is allowed on a bad value."""
        model_type = cfg.get("model_type")
        if model_type not in MODEL_TYPES:
            raise ConfigError(
                f"{source}: model_type={model_type!r} is not supported; expected one of "
                f"{', '.join(MODEL_TYPES)}"
            )
        hidden = values.integer(cfg, "hidden_size", source)
        n_layers = values.integer(cfg, "num_hidden_layers", source)
        n_heads = values.integer(cfg, "num_attention_heads", source)
        n_kv = values.integer(cfg, "num_key_value_heads", source, default=n_heads)
        if n_heads % n_kv:
            raise ConfigError(
                f"{source}: num_attention_heads={n_heads} is not a multiple of num_key_value_heads={n_kv}"
            )
        # Qwen2 has no head_dim key: it is always hidden / heads (as in mlx-lm).
        head_dim = hidden // n_heads
        if model_type != "qwen2":
            head_dim = values.integer(cfg, "head_dim", source, default=head_dim)
        if head_dim < 1:
            raise ConfigError(
                f"{source}: num_attention_heads={n_heads} is more than hidden_size={hidden}, "
                "so a head has no dimension; set head_dim"
            )
        return cls(
            model_type=model_type,
            hidden_size=hidden,
            num_hidden_layers=n_layers,
            intermediate_size=values.integer(cfg, "intermediate_size", source),
            num_attention_heads=n_heads,
            num_key_value_heads=n_kv,
            vocab_size=values.integer(cfg, "vocab_size", source),
            head_dim=head_dim,
            rms_norm_eps=values.number(cfg, "rms_norm_eps", source, 1e-6),
            rope_theta=values.number(cfg, "rope_theta", source, 1000000.0 if model_type == "qwen2" else 10000.0),
            rope_scaling=_rope_scaling(cfg.get("rope_scaling"), source),
            tie_word_embeddings=values.boolean(cfg, "tie_word_embeddings", source, model_type == "qwen2"),
            attention_bias=model_type == "qwen2" or values.boolean(cfg, "attention_bias", source, False),
            mlp_bias=model_type != "qwen2" and values.boolean(cfg, "mlp_bias", source, False),
            windows=_layer_windows(cfg, model_type, n_layers, source),
            eos_token_id=values.token_ids(cfg.get("eos_token_id"), "eos_token_id", source),
        )

    def layer_configs(self) -> tuple[LayerConfig, ...]:
        """The cache's per-layer shapes: sliding-window layers become ring layers."""
        return tuple(
            LayerConfig(
                self.num_key_value_heads,
                self.head_dim,
                LayerPolicy("ring", w) if w else LayerPolicy(),
            )
            for w in self.windows
        )


def _layer_windows(cfg: Mapping[str, Any], model_type: str, n_layers: int, source: str) -> tuple[int, ...]:
    """Which layers attend through a sliding window, following the HF configs.

    Mistral (and Llama with `sliding_window`) slide on every layer unless
    `layer_types` says otherwise; Qwen2 slides only with `use_sliding_window`,
    and then only from layer `max_window_layers` on. A key that does not
    apply (Qwen2's window without `use_sliding_window`) is not read.
    """
    if model_type == "qwen2" and not values.boolean(cfg, "use_sliding_window", source, False):
        return (0,) * n_layers
    window = values.integer(cfg, "sliding_window", source, minimum=0, default=0)  # 0 or null: no window
    if not window:
        return (0,) * n_layers
    layer_types = cfg.get("layer_types")
    if layer_types is not None:
        kinds = ("sliding_attention", "full_attention")
        if not isinstance(layer_types, list) or not all(t in kinds for t in layer_types):
            raise ConfigError(
                f"{source}: layer_types={layer_types!r}: expected a list of "
                f"{' or '.join(map(repr, kinds))}, one per layer"
            )
        if len(layer_types) != n_layers:
            raise ConfigError(
                f"{source}: layer_types has {len(layer_types)} entries, num_hidden_layers={n_layers}"
            )
        return tuple(window if t == "sliding_attention" else 0 for t in layer_types)
    if model_type == "qwen2":
        first = values.integer(cfg, "max_window_layers", source, minimum=0, default=0)
        return tuple(window if i >= first else 0 for i in range(n_layers))
    return (window,) * n_layers


ROPE_TYPES = ("default", "linear", "llama3")


def _rope_scaling(rope_scaling: Any, source: str) -> dict | None:
    """config.json's `rope_scaling`, checked for what rope_freqs reads: null, or an object of a type we apply."""
    if rope_scaling is None:
        return None
    if not isinstance(rope_scaling, Mapping):
        raise ConfigError(f"{source}: rope_scaling={rope_scaling!r}: expected null or an object with a rope_type")
    rope_type = _rope_type(rope_scaling)
    if rope_type not in ROPE_TYPES:
        raise ConfigError(
            f"{source}: rope_scaling type {rope_type!r} is not supported; expected {', '.join(ROPE_TYPES)}"
        )
    where = f"{source}: rope_scaling"
    if rope_type != "default":
        if "factor" not in rope_scaling:
            raise ConfigError(f"{where}: missing key 'factor' (a {rope_type} rope_scaling needs it)")
        values.positive_number(rope_scaling["factor"], "factor", where)
    if rope_type == "llama3":
        low = values.number(rope_scaling, "low_freq_factor", where, 1.0)
        high = values.number(rope_scaling, "high_freq_factor", where, 4.0)
        if high <= low:
            raise ConfigError(f"{where}: high_freq_factor={high} must be more than low_freq_factor={low}")
        values.integer(rope_scaling, "original_max_position_embeddings", where, default=8192)
    return dict(rope_scaling)


def _rope_type(rope_scaling: Mapping[str, Any]) -> str:
    """HF spells it "type" in older configs, "rope_type" in newer ones."""
    return rope_scaling.get("type") or rope_scaling.get("rope_type", "default")


def rope_freqs(args: ModelArgs) -> tuple[float | None, float, mx.array | None]:
    """(base, scale, freqs) for mx.fast.rope, as mlx-lm's initialize_rope builds them."""
    cfg = args.rope_scaling
    rope_type = "default" if cfg is None else _rope_type(cfg)
    if rope_type == "default":
        return args.rope_theta, 1.0, None
    if rope_type == "linear":
        return args.rope_theta, 1.0 / cfg["factor"], None
    # llama3: long wavelengths stretched by `factor`, a smooth ramp in between.
    dims, base = args.head_dim, args.rope_theta
    factor = cfg["factor"]
    low, high = cfg.get("low_freq_factor", 1.0), cfg.get("high_freq_factor", 4.0)
    old_len = cfg.get("original_max_position_embeddings", 8192)
    freqs = base ** (mx.arange(0, dims, 2) / dims)
    wavelens = 2 * mx.pi * freqs
    freqs = mx.where(wavelens > old_len / low, freqs * factor, freqs)
    medium = (wavelens > old_len / high) & (wavelens < old_len / low)
    smooth = (old_len / wavelens - low) / (high - low)
    smooth_freqs = freqs / ((1 - smooth) / factor + smooth)
    return None, 1.0, mx.where(medium, smooth_freqs, freqs)


class RoPE:
    """Rotate-half rotary embedding at explicit per-token positions.

    A flat step mixes sequences, so there is no single offset. mx.fast.rope
    takes one offset per batch entry: we put the tokens on the batch axis
    (`[T, H, 1, D]`) and hand it the positions, which is the same kernel
    mlx-lm uses and therefore bit-identical to it.
    """

    def __init__(self, args: ModelArgs):
        self.dims = args.head_dim
        self.base, self.scale, self.freqs = rope_freqs(args)

    def __call__(self, x: mx.array, positions: mx.array) -> mx.array:
        if x.shape[2] == 1:  # one token: [1, H, 1, D] already has it on the batch axis
            return self._rope(x, positions)
        xt = x.transpose(2, 1, 0, 3)  # [1, H, T, D] -> [T, H, 1, D]
        return self._rope(xt, positions).transpose(2, 1, 0, 3)  # [1, H, T, D]

    def _rope(self, x: mx.array, offsets: mx.array) -> mx.array:
        return mx.fast.rope(
            x, self.dims, traditional=False, base=self.base, scale=self.scale, offset=offsets, freqs=self.freqs
        )


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.layer = layer
        self.n_heads, self.n_kv_heads = args.num_attention_heads, args.num_key_value_heads
        self.head_dim = args.head_dim
        self.scale = 1.0 / math.sqrt(self.head_dim)
        dim, hd, bias = args.hidden_size, args.head_dim, args.attention_bias
        self.q_proj = nn.Linear(dim, self.n_heads * hd, bias=bias)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * hd, bias=bias)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * hd, bias=bias)
        # Qwen2 biases q/k/v only; Llama's attention_bias covers o_proj too.
        self.o_proj = nn.Linear(self.n_heads * hd, dim, bias=bias and args.model_type != "qwen2")
        self.rope = RoPE(args)

    def __call__(self, x: mx.array, positions: mx.array, pos_host: np.ndarray, cache: Any) -> mx.array:
        _, T, _ = x.shape
        q = self.q_proj(x).reshape(1, T, self.n_heads, -1).transpose(0, 2, 1, 3)  # [1, Hq, T, D]
        k = self.k_proj(x).reshape(1, T, self.n_kv_heads, -1).transpose(0, 2, 1, 3)  # [1, Hkv, T, D]
        v = self.v_proj(x).reshape(1, T, self.n_kv_heads, -1).transpose(0, 2, 1, 3)  # [1, Hkv, T, D]
        q, k = self.rope(q, positions), self.rope(k, positions)
        # The layout decides where K/V go and what this step may see.
        spec = cache.update_and_fetch(self.layer, pos_host, k, v)
        o = attend(q, spec, self.scale)  # [1, Hq, T, D]
        return self.o_proj(o.transpose(0, 2, 1, 3).reshape(1, T, -1))  # [1, T, hidden]


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        dim, hidden, bias = args.hidden_size, args.intermediate_size, args.mlp_bias
        self.gate_proj = nn.Linear(dim, hidden, bias=bias)
        self.up_proj = nn.Linear(dim, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, dim, bias=bias)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


@functools.partial(mx.compile, shapeless=True)
def swiglu(gate: mx.array, x: mx.array) -> mx.array:
    """silu(gate) * x as one fused op, as mlx-lm's MLP computes it: one kernel instead of two,
    and in a half-precision model the same rounding as mlx-lm's (no trip through memory between)."""
    return nn.silu(gate) * x


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.self_attn = Attention(args, layer)
        self.mlp = MLP(args)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x, positions, pos_host, cache):
        h = x + self.self_attn(self.input_layernorm(x), positions, pos_host, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class Backbone(nn.Module):
    """HF's `model.` prefix: embeddings, layers, final norm."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [DecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)


class Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model = Backbone(args)
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
        # One int64 array for every layer's cache: a list would be converted and checked again by
        # the layout at each layer (~0.1 ms per layer at 512 tokens).
        pos_host = np.asarray(positions, dtype=np.int64)  # [T]
        if pos_host.shape != (len(tokens),):
            raise ShapeError(f"{len(tokens)} token(s) but {pos_host.size} position(s): expected one position per token")
        pos = mx.array(pos_host.astype(np.int32))  # [T]
        h = self.model.embed_tokens(mx.array(tokens, dtype=mx.int32))[None]  # [1, T, hidden]
        for layer in self.model.layers:
            h = layer(h, pos, pos_host, cache)
        h = h[0]  # [T, hidden]
        if rows is not None and not (len(rows) == len(tokens) == 1):  # one token: its row is h
            h = h[mx.array(rows, dtype=mx.int32)]  # [R, hidden]
        h = self.model.norm(h)
        if self.args.tie_word_embeddings:
            # The embedding as the head: a plain matmul, or a quantized one when it is packed.
            return self.model.embed_tokens.as_linear(h)  # [R, V]
        return self.lm_head(h)  # [R, V]
