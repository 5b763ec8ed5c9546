"""Phi-3 (and Phi-3.5 / Phi-4-mini, `model_type` "phi3"): the Llama block with fused projections.

What differs from Llama, as mlx-lm's `phi3` writes it:

- q, k and v are one fused `qkv_proj` (split as `[q | k | v]` along the output) and the MLP's gate
  and up projections one fused `gate_up_proj`: the MLP is mlx-lm's own `phi3.MLP`;
- `head_dim` is always hidden_size / num_attention_heads (a `head_dim` key saying otherwise is
  refused);
- RoPE turns only the first int(head_dim * `partial_rotary_factor`) dims of a head (Phi-4-mini);
- `rope_scaling` is null, "linear" (`nn.RoPE` with scale 1 / factor) or "longrope" / "su" (mlx-lm's
  `SuScaledRoPE`, from `max_position_embeddings` / `original_max_position_embeddings`, both
  required, and `long_factor`, one entry per rotated pair). mlx-lm warns and drops any other type;
  kvlayout refuses it. Like mlx-lm, LongRoPE always rotates with `long_factor`: Hugging Face uses
  `short_factor` while a sequence is within `original_max_position_embeddings` and `long_factor`
  past it, so on sequences that short HF computes something else than mlx-lm and kvlayout.
  `rope_traditional` (an mlx-lm key) picks the interleaved rotation of a plain / linear RoPE;
  SuScaledRoPE has only rotate-half, so it is refused with longrope.

`sliding_window` (Phi-3-mini-4k says 2047): Hugging Face masks every layer with it, mlx-lm ignores
it. kvlayout honours it as HF does, a window on every layer (as Mistral: a query sees the last
`sliding_window` keys, itself included, HF's `kv_idx > q_idx - sliding_window`); null or absent is none.
So kvlayout agrees with mlx-lm only while a sequence stays within the window.

Refused rather than ignored: `attention_bias` / `mlp_bias` true (neither HF's nor mlx-lm's Phi-3
has biases), `hidden_act` other than "silu", and a LongRoPE `attention_factor` (HF applies it,
mlx-lm does not). A scaled RoPE said only in transformers 5's `rope_parameters` is read as
`rope_scaling` (`args.lift_rope_parameters`). Tensor parallelism is not this module's (`kvlayout.models.shard`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import phi3 as mlx_lm_phi3
from mlx_lm.models.rope_utils import SuScaledRoPE

from kvlayout.checks import finite
from kvlayout.errors import ConfigError
from kvlayout.models import config_values as values
from kvlayout.models.args import ModelArgs, read_shape, refuse_set, rope_scaling, rope_type
from kvlayout.models.flat import DecoderModel, PreNormBlock, RopeAt, attend_through, heads
from kvlayout.positions import StepPositions

MODEL_TYPES = ("phi3",)

ROPE_TYPES = ("linear", "longrope", "su")
ROPE_NEEDS = {"linear": ("factor",), "longrope": ("short_factor", "long_factor"),
              "su": ("short_factor", "long_factor")}
# Keys whose other values neither mlx-lm's Phi-3 nor kvlayout's computes.
UNSUPPORTED = {"attention_bias": False, "mlp_bias": False, "hidden_act": "silu"}


@attrs.frozen
class Rotary:
    """Phi-3's own RoPE fields, checked."""

    dims: int  # rotated dims of a head: int(head_dim * partial_rotary_factor)
    traditional: bool
    original_max_position_embeddings: int | None  # LongRoPE's pretrained length; None without LongRoPE


def read_args(cfg: Mapping[str, Any], source: str = "config.json") -> ModelArgs:
    """Read a Phi-3 HF config dict; one ConfigError naming the file and the key on a bad value."""
    refuse_set(cfg, source, UNSUPPORTED)
    shape = read_shape(cfg, source, head_dim_key=False)
    _check_head_dim(cfg, shape, source)
    # HF's Phi3Config default (mlx-lm has none: its configs always carry the key).
    shape["rms_norm_eps"] = values.number(cfg, "rms_norm_eps", source, 1e-5)
    scaling = rope_scaling(cfg, source, ROPE_TYPES, ROPE_NEEDS)
    rotary = read_rotary(cfg, shape, scaling, source)
    window = values.integer(cfg, "sliding_window", source, minimum=0, default=0)  # 0 or null: no window
    return ModelArgs(
        model_type="phi3",
        **shape,
        rope_theta=values.number(cfg, "rope_theta", source, 10000.0),
        rope_scaling=scaling,
        tie_word_embeddings=values.boolean(cfg, "tie_word_embeddings", source, False),
        windows=(window,) * shape["num_hidden_layers"],
        extra=rotary,
    )


def _check_head_dim(cfg: Mapping[str, Any], shape: dict, source: str) -> None:
    """mlx-lm's Phi-3 always splits hidden_size evenly over the heads; a `head_dim` saying otherwise
    would be a different model."""
    given = cfg.get("head_dim")
    if given is not None and given != shape["head_dim"]:
        raise ConfigError(
            f"{source}: head_dim={given!r} is not supported by kvlayout's phi3: a head is "
            f"hidden_size / num_attention_heads = {shape['head_dim']}"
        )


def read_rotary(cfg: Mapping[str, Any], shape: dict, scaling: dict | None, source: str) -> Rotary:
    """partial_rotary_factor, rope_traditional, and what the rope_scaling type needs, checked."""
    factor = cfg.get("partial_rotary_factor", 1.0)
    if not (finite(factor) and 0 < factor <= 1):
        raise ConfigError(f"{source}: partial_rotary_factor={factor!r}: expected a number > 0 and <= 1")
    dims = int(shape["head_dim"] * factor)
    if dims < 2 or dims % 2:
        raise ConfigError(
            f"{source}: partial_rotary_factor={factor!r} rotates {dims} of head_dim={shape['head_dim']} dims; "
            "RoPE needs an even number >= 2"
        )
    traditional = values.boolean(cfg, "rope_traditional", source, False)
    kind = None if scaling is None else rope_type(scaling)
    if kind == "linear":
        values.positive_number(scaling["factor"], "factor", f"{source}: rope_scaling")
    original = None
    if kind in ("longrope", "su"):
        original = _check_longrope(cfg, scaling, dims, traditional, source)
    return Rotary(dims=dims, traditional=traditional, original_max_position_embeddings=original)


def _check_longrope(cfg: Mapping[str, Any], scaling: dict, dims: int, traditional: bool, source: str) -> int:
    """LongRoPE's keys: a factor per rotated pair in both lists, both lengths given (HF and mlx-lm
    default them differently, so neither default is taken); the pretrained length returned."""
    where = f"{source}: rope_scaling"
    if traditional:
        raise ConfigError(f"{source}: rope_traditional=True is not supported with a {rope_type(scaling)} "
                          "rope_scaling (LongRoPE rotates halves)")
    for key in ("short_factor", "long_factor"):
        factors = scaling[key]
        if not isinstance(factors, list) or not all(finite(f) and f > 0 for f in factors):
            raise ConfigError(f"{where}: {key}={factors!r}: expected a list of numbers > 0")
        if len(factors) != dims // 2:
            raise ConfigError(
                f"{where}: {key} has {len(factors)} entries; expected {dims // 2} "
                f"(one per rotated pair: {dims} rotated dims)"
            )
    if scaling.get("attention_factor") is not None:
        raise ConfigError(f"{where}: attention_factor={scaling['attention_factor']!r} is not supported by "
                          "kvlayout's phi3 (mlx-lm's scales from the lengths); remove it or set null")
    for key in ("max_position_embeddings", "original_max_position_embeddings"):
        if cfg.get(key) is None:
            raise ConfigError(f"{source}: missing key {key!r} (a {rope_type(scaling)} rope_scaling needs it: "
                              "HF and mlx-lm default it differently)")
    values.integer(cfg, "max_position_embeddings", source)
    return values.integer(cfg, "original_max_position_embeddings", source)


def make_rope(args: ModelArgs) -> RopeAt:
    """mlx-lm's Phi-3 RoPE for these args (its choice of module) at per-token positions."""
    rotary, scaling = args.extra, args.rope_scaling
    kind = None if scaling is None else rope_type(scaling)
    if kind in ("longrope", "su"):
        rope = SuScaledRoPE(
            rotary.dims,
            base=args.rope_theta,
            max_position_embeddings=args.max_position_embeddings,
            original_max_position_embeddings=rotary.original_max_position_embeddings,
            short_factor=scaling["short_factor"],
            long_factor=scaling["long_factor"],
        )
    else:
        scale = 1.0 / scaling["factor"] if kind == "linear" else 1.0
        rope = nn.RoPE(rotary.dims, traditional=rotary.traditional, base=args.rope_theta, scale=scale)
    return RopeAt(rope)


class Attention(nn.Module):
    """mlx-lm's Phi-3 attention on the flat step: one fused `qkv_proj`, RoPE at per-token positions,
    attention through the cache."""

    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.layer = layer
        self.n_heads, self.n_kv_heads = args.num_attention_heads, args.num_key_value_heads
        hd = args.head_dim
        self.scale = hd**-0.5
        self.q_size, self.kv_size = self.n_heads * hd, self.n_kv_heads * hd
        self.qkv_proj = nn.Linear(args.hidden_size, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = nn.Linear(self.q_size, args.hidden_size, bias=False)
        self.rope = make_rope(args)

    def __call__(self, x: mx.array, positions: int | mx.array, pos_host: StepPositions, cache: Any) -> mx.array:
        qkv = self.qkv_proj(x)  # [1, T, (Hq + 2 Hkv) * D]
        q, k, v = mx.split(qkv, [self.q_size, self.q_size + self.kv_size], axis=-1)
        q = heads(q, self.n_heads)  # [1, Hq, T, D]
        k, v = heads(k, self.n_kv_heads), heads(v, self.n_kv_heads)  # [1, Hkv, T, D]
        q, k = self.rope(q, positions), self.rope(k, positions)
        return self.o_proj(attend_through(cache, self.layer, pos_host, q, k, v, self.scale))  # [1, T, hidden]


def build(args: ModelArgs) -> DecoderModel:
    """The model `args` describes, with fresh (random) weights."""
    layers = [
        PreNormBlock(Attention(args, i), mlx_lm_phi3.MLP(args.hidden_size, args.intermediate_size),
                     args.hidden_size, args.rms_norm_eps)
        for i in range(args.num_hidden_layers)
    ]
    return DecoderModel(args, layers, nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps))
