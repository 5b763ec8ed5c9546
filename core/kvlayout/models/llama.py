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

import math
from typing import Any, Mapping, Sequence

import attrs
import mlx.core as mx
import mlx.nn as nn
import numpy as np

from kvlayout.config import LayerConfig, LayerPolicy
from kvlayout.errors import ConfigError
from kvlayout.mlx import attend

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
        """Read an HF config dict; ConfigError names the key and the file on a bad value."""
        model_type = cfg.get("model_type")
        if model_type not in MODEL_TYPES:
            raise ConfigError(
                f"{source}: model_type={model_type!r} is not supported; expected one of "
                f"{', '.join(MODEL_TYPES)}"
            )

        def need(key):
            if key not in cfg:
                raise ConfigError(f"{source}: missing key {key!r} (needed by a {model_type} model)")
            return cfg[key]

        hidden = int(need("hidden_size"))
        n_layers = int(need("num_hidden_layers"))
        n_heads = int(need("num_attention_heads"))
        n_kv = int(cfg.get("num_key_value_heads") or n_heads)
        # Qwen2 has no head_dim key: it is always hidden / heads (as in mlx-lm).
        head_dim = int(cfg.get("head_dim") or hidden // n_heads) if model_type != "qwen2" else hidden // n_heads
        if n_heads % n_kv:
            raise ConfigError(
                f"{source}: num_attention_heads={n_heads} is not a multiple of num_key_value_heads={n_kv}"
            )
        rope_scaling = cfg.get("rope_scaling")
        if rope_scaling is not None:
            rope_type = _rope_type(rope_scaling)
            if rope_type not in ("default", "linear", "llama3"):
                raise ConfigError(
                    f"{source}: rope_scaling type {rope_type!r} is not supported; "
                    "expected default, linear or llama3"
                )
        eos = cfg.get("eos_token_id")
        eos = () if eos is None else tuple(eos) if isinstance(eos, list) else (int(eos),)
        return cls(
            model_type=model_type,
            hidden_size=hidden,
            num_hidden_layers=n_layers,
            intermediate_size=int(need("intermediate_size")),
            num_attention_heads=n_heads,
            num_key_value_heads=n_kv,
            vocab_size=int(need("vocab_size")),
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(cfg.get("rope_theta", 1000000.0 if model_type == "qwen2" else 10000.0)),
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", model_type == "qwen2")),
            attention_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
            mlp_bias=model_type != "qwen2" and bool(cfg.get("mlp_bias", False)),
            windows=_layer_windows(cfg, model_type, n_layers, source),
            eos_token_id=eos,
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
    and then only from layer `max_window_layers` on.
    """
    window = cfg.get("sliding_window")
    if model_type == "qwen2" and not cfg.get("use_sliding_window", False):
        window = None
    if not window:
        return (0,) * n_layers
    window = int(window)
    layer_types = cfg.get("layer_types")
    if layer_types is not None:
        if len(layer_types) != n_layers:
            raise ConfigError(
                f"{source}: layer_types has {len(layer_types)} entries, num_hidden_layers={n_layers}"
            )
        return tuple(window if t == "sliding_attention" else 0 for t in layer_types)
    if model_type == "qwen2":
        first = int(cfg.get("max_window_layers", 0))
        return tuple(window if i >= first else 0 for i in range(n_layers))
    return (window,) * n_layers


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
        xt = x.transpose(2, 1, 0, 3)  # [1, H, T, D] -> [T, H, 1, D]
        y = mx.fast.rope(
            xt, self.dims, traditional=False, base=self.base, scale=self.scale,
            offset=positions, freqs=self.freqs,
        )
        return y.transpose(2, 1, 0, 3)  # [1, H, T, D]


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
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


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
            raise ValueError(f"{len(tokens)} token(s) but {pos_host.size} position(s)")
        pos = mx.array(pos_host.astype(np.int32))  # [T]
        h = self.model.embed_tokens(mx.array(tokens, dtype=mx.int32))[None]  # [1, T, hidden]
        for layer in self.model.layers:
            h = layer(h, pos, pos_host, cache)
        h = h[0]  # [T, hidden]
        if rows is not None:
            h = h[mx.array(rows, dtype=mx.int32)]  # [R, hidden]
        h = self.model.norm(h)
        if self.args.tie_word_embeddings:
            # The embedding as the head: a plain matmul, or a quantized one when it is packed.
            return self.model.embed_tokens.as_linear(h)  # [R, V]
        return self.lm_head(h)  # [R, V]
