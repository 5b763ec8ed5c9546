"""A Llama-family decoder (Llama, Mistral, Qwen2) whose K/V live in a kvlayout cache.

Numerically the Hugging Face definition, as mlx-lm writes it: RMSNorm, rotate-half
rotary embeddings, grouped-query attention, SwiGLU MLP, tied or untied head,
q/k/v biases for Qwen2. Parameter names match the HF checkpoint names
(`model.layers.0.self_attn.q_proj.weight`), so a safetensors file loads as is.

What differs from mlx-lm is the step (one flat token axis, per-token
positions, attention through the cache): `kvlayout.models.flat`. The Llama
family keeps its own RoPE frequencies instead of mlx-lm's `initialize_rope`
so that running it never imports mlx-lm (and transformers behind it).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from kvlayout.errors import ConfigError
from kvlayout.models import config_values as values
from kvlayout.models.args import ModelArgs, layer_types, read_shape, rope_type, windows_of
from kvlayout.models.args import rope_scaling as read_rope_scaling
from kvlayout.models.flat import Attention, DecoderModel, PreNormBlock

MODEL_TYPES = ("llama", "mistral", "qwen2")


def read_args(cfg: Mapping[str, Any], source: str = "config.json") -> ModelArgs:
    """Read a Llama-family HF config dict; ConfigError names the file, the key and what is allowed on a bad value."""
    model_type = cfg.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ConfigError(
            f"{source}: model_type={model_type!r} is not supported; expected one of {', '.join(MODEL_TYPES)}"
        )
    # Qwen2 has no head_dim key: it is always hidden / heads (as in mlx-lm).
    shape = read_shape(cfg, source, head_dim_key=model_type != "qwen2")
    return ModelArgs(
        model_type=model_type,
        **shape,
        rope_theta=values.number(cfg, "rope_theta", source, 1000000.0 if model_type == "qwen2" else 10000.0),
        rope_scaling=_rope_scaling(cfg.get("rope_scaling"), source),
        tie_word_embeddings=values.boolean(cfg, "tie_word_embeddings", source, model_type == "qwen2"),
        attention_bias=model_type == "qwen2" or values.boolean(cfg, "attention_bias", source, False),
        mlp_bias=model_type != "qwen2" and values.boolean(cfg, "mlp_bias", source, False),
        windows=_layer_windows(cfg, model_type, shape["num_hidden_layers"], source),
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
    kinds = layer_types(cfg, n_layers, source)
    if kinds is not None:
        return windows_of(kinds, window)
    if model_type == "qwen2":
        first = values.integer(cfg, "max_window_layers", source, minimum=0, default=0)
        return tuple(window if i >= first else 0 for i in range(n_layers))
    return (window,) * n_layers


ROPE_TYPES = ("default", "linear", "llama3")


def _rope_scaling(rope_scaling: Any, source: str) -> dict | None:
    """config.json's `rope_scaling`, checked for what rope_freqs reads: null, or an object of a type we apply."""
    checked = read_rope_scaling({"rope_scaling": rope_scaling}, source, ROPE_TYPES,
                                needs={"linear": ("factor",), "llama3": ("factor",)})
    if checked is None:
        return None
    kind, where = rope_type(checked), f"{source}: rope_scaling"
    if kind != "default":
        values.positive_number(checked["factor"], "factor", where)
    if kind == "llama3":
        low = values.number(checked, "low_freq_factor", where, 1.0)
        high = values.number(checked, "high_freq_factor", where, 4.0)
        if high <= low:
            raise ConfigError(f"{where}: high_freq_factor={high} must be more than low_freq_factor={low}")
        values.integer(checked, "original_max_position_embeddings", where, default=8192)
    return checked


def rope_freqs(args: ModelArgs) -> tuple[float | None, float, mx.array | None]:
    """(base, scale, freqs) for mx.fast.rope, as mlx-lm's initialize_rope builds them."""
    cfg = args.rope_scaling
    kind = "default" if cfg is None else rope_type(cfg)
    if kind == "default":
        return args.rope_theta, 1.0, None
    if kind == "linear":
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
    mlx-lm uses and therefore bit-identical to it. A step whose positions run consecutively
    comes as an int offset instead: mlx-lm's own call (a position's rotation is the same either way).
    """

    def __init__(self, args: ModelArgs):
        self.dims = args.head_dim
        self.base, self.scale, self.freqs = rope_freqs(args)

    def __call__(self, x: mx.array, positions: int | mx.array) -> mx.array:
        if isinstance(positions, int) or x.shape[2] == 1:
            # Consecutive positions from an int (mlx-lm's own call), or one token: [1, H, 1, D]
            # already has it on the batch axis.
            return self._rope(x, positions)
        xt = x.transpose(2, 1, 0, 3)  # [1, H, T, D] -> [T, H, 1, D]
        return self._rope(xt, positions).transpose(2, 1, 0, 3)  # [1, H, T, D]

    def _rope(self, x: mx.array, offsets: int | mx.array) -> mx.array:
        if self.freqs is None:  # passing freqs=None costs the call ~1 us more (twice a layer, every step)
            return mx.fast.rope(x, self.dims, traditional=False, base=self.base, scale=self.scale, offset=offsets)
        return mx.fast.rope(
            x, self.dims, traditional=False, base=self.base, scale=self.scale, offset=offsets, freqs=self.freqs
        )


def attention(args: ModelArgs, layer: int) -> Attention:
    # Qwen2 biases q/k/v only; Llama's attention_bias covers o_proj too.
    o_bias = args.attention_bias and args.model_type != "qwen2"
    return Attention(args, layer, RoPE(args), 1.0 / math.sqrt(args.head_dim), args.attention_bias, o_bias)


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
    and in a half-precision model the same rounding as mlx-lm's (no trip through memory between).
    (mlx-lm's own `activations.swiglu` is this; the Llama family does not import mlx-lm, which
    costs ~1.7 s at startup through transformers.)"""
    return nn.silu(gate) * x


def build(args: ModelArgs) -> DecoderModel:
    """The model `args` describes, with fresh (random) weights."""
    layers = [
        PreNormBlock(attention(args, i), MLP(args), args.hidden_size, args.rms_norm_eps)
        for i in range(args.num_hidden_layers)
    ]
    return DecoderModel(args, layers, nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps))
