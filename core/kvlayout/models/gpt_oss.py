"""gpt-oss: attention sinks, sliding layers alternating with full ones, YaRN RoPE, a mixture of experts.

What differs from Llama, as mlx-lm's `gpt_oss` computes it:

- Attention: q/k/v/o projections with biases, scale 1/sqrt(head_dim), and one learned sink logit per
  query head (`self_attn.sinks`) that joins every softmax and carries no value
  (`flat.attend_through(..., sinks=)`; `kvlayout.mlx.attend` takes it on every path).
- Layer kinds from `layer_types`; absent, HF's and mlx-lm's default: sliding, full, sliding, ... An
  odd layer count without `layer_types` is refused: mlx-lm's default list is one short (its loop
  then drops the last layer), HF's is not, so the two readers would run different models. A sliding
  layer attends `sliding_window` keys (itself included): `ModelArgs.windows`.
- RoPE: mlx-lm's `initialize_rope` (default, linear, llama3, yarn) at per-token positions
  (`flat.RopeAt`); "dynamic" and the others are refused. YaRN's `truncate` is HF's: true (HF's
  default) floors/ceils the correction range, which is what mlx-lm's YarnRoPE always does; false
  (what OpenAI's gpt-oss configs say, and what OpenAI's reference implementation computes) keeps
  the range unrounded. mlx-lm ignores the key, so on a `truncate: false` config kvlayout follows HF
  (`UnroundedYarn`) and differs from mlx-lm's frequencies by that rounding. YaRN keys mlx-lm and HF
  read differently (`attention_factor`, `mscale` without `mscale_all_dim` or the reverse) are refused.
- `rope_scaling` absent: HF's GptOssConfig then runs its default YaRN (factor 32) while mlx-lm runs
  plain RoPE; the key is required (null for plain RoPE, as mlx-lm and HF both read an explicit null).
- MLP: mlx-lm's own `gpt_oss.MLPBlock` (router with bias, top-k of the router logits then a softmax
  of those k, `SwitchGLU` with the clamped `SwigluOAI` and biases: `mlp.router`,
  `mlp.experts.{gate,up,down}_proj`). It works per token on `[1, T, hidden]`, so a flat step needs
  nothing of its own. `swiglu_alpha` / `swiglu_limit` other than mlx-lm's fixed 1.702 / 7.0 are refused.
- The head is never tied (`lm_head`); `tie_word_embeddings: true` and `attention_bias: false` are
  refused (mlx-lm builds neither).

HF checkpoints fuse each layer's gate and up experts (`experts.gate_up_proj` `[E, hidden, 2 * I]`,
gate and up interleaved on the last axis, multiplied as `x @ W`) and store `down_proj` `[E, I,
hidden]`; `sanitize` splits and transposes them into mlx-lm's `[E, out, in]`. OpenAI's MXFP4 tensors
(`*_blocks` / `*_scales`) are refused: `mlx_lm.convert` writes them as a directory kvlayout reads.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

import attrs
import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import gpt_oss as mlx_lm_gpt_oss
from mlx_lm.models.rope_utils import initialize_rope

from kvlayout.errors import ConfigError
from kvlayout.models import config_values as values
from kvlayout.models.args import ModelArgs, layer_types, read_shape, refuse_set, rope_scaling, rope_type, windows_of
from kvlayout.models.flat import Attention, DecoderModel, PreNormBlock, RopeAt

MODEL_TYPES = ("gpt_oss",)

# The rope_scaling types mlx-lm's initialize_rope applies position by position, and the keys each needs
# (YaRN's original length: mlx-lm defaults it to 4096, HF requires it).
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
ROPE_NEEDS = {"linear": ("factor",), "llama3": ("factor",), "yarn": ("factor", "original_max_position_embeddings")}
# Keys HF's GptOssConfig reads whose other values mlx-lm's gpt_oss does not compute.
UNSUPPORTED = {"tie_word_embeddings": False, "attention_bias": True, "swiglu_alpha": 1.702, "swiglu_limit": 7.0}
# HF's and mlx-lm's defaults where they agree.
DEFAULT_HEAD_DIM = 64
DEFAULT_WINDOW = 128


@attrs.frozen
class Experts:
    """gpt-oss's own config fields, checked."""

    num_local_experts: int
    num_experts_per_tok: int
    layer_types: tuple[str, ...]
    sliding_window: int


def read_args(cfg: Mapping[str, Any], source: str = "config.json") -> ModelArgs:
    """Read a gpt-oss config dict; a bad or unimplemented value is one ConfigError naming the key."""
    refuse_set(cfg, source, UNSUPPORTED)
    if cfg.get("head_dim") is None:  # hidden / heads is not gpt-oss's default (2880 / 64 = 45)
        cfg = {**cfg, "head_dim": DEFAULT_HEAD_DIM}
    shape = read_shape(cfg, source)
    extra = read_experts(cfg, shape["num_hidden_layers"], source)
    return ModelArgs(
        model_type=cfg["model_type"],
        **shape,
        rope_theta=values.number(cfg, "rope_theta", source, 150000.0),
        rope_scaling=read_rope_scaling(cfg, source),
        attention_bias=True,
        mlp_bias=True,
        windows=windows_of(extra.layer_types, extra.sliding_window),
        extra=extra,
    )


def read_experts(cfg: Mapping[str, Any], n_layers: int, source: str) -> Experts:
    """The experts' and the layer kinds' keys, checked."""
    n_experts = values.integer(cfg, "num_local_experts", source, default=128)
    top_k = values.integer(cfg, "num_experts_per_tok", source, default=4)
    if top_k > n_experts:
        raise ConfigError(
            f"{source}: num_experts_per_tok={top_k} is more than num_local_experts={n_experts}; "
            "a token is routed to at most every expert"
        )
    kinds = layer_types(cfg, n_layers, source)
    if kinds is None:
        if n_layers % 2:
            raise ConfigError(
                f"{source}: layer_types is missing and num_hidden_layers={n_layers} is odd: mlx-lm's default "
                "(sliding, full) * (layers // 2) leaves the last layer out where HF's does not; set layer_types"
            )
        kinds = ("sliding_attention", "full_attention") * (n_layers // 2)
    window = values.integer(cfg, "sliding_window", source, default=DEFAULT_WINDOW)
    return Experts(n_experts, top_k, kinds, window)


def read_rope_scaling(cfg: Mapping[str, Any], source: str) -> dict | None:
    """`rope_scaling`, required (HF's absent default is YaRN, mlx-lm's none), of a type applied per position."""
    if "rope_scaling" not in cfg:
        raise ConfigError(
            f"{source}: missing key 'rope_scaling': HF's gpt-oss then runs YaRN (factor 32), mlx-lm plain RoPE; "
            "write it out (null for plain RoPE)"
        )
    checked = rope_scaling(cfg, source, ROPE_TYPES, ROPE_NEEDS)
    if checked is None:
        return None
    kind, where = rope_type(checked), f"{source}: rope_scaling"
    if kind != "default":
        values.positive_number(checked["factor"], "factor", where)
    if kind == "yarn":
        read_yarn(checked, where)
    return checked


def read_yarn(checked: Mapping[str, Any], where: str) -> None:
    """YaRN's keys where mlx-lm's YarnRoPE and HF's agree (or kvlayout follows HF: `truncate`)."""
    values.integer(checked, "original_max_position_embeddings", where)
    for key in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim"):
        values.number(checked, key, where, 1.0)  # when given, a number > 0
    values.boolean(checked, "truncate", where, True)
    if checked.get("attention_factor") is not None:
        raise ConfigError(
            f"{where}: attention_factor={checked['attention_factor']!r} is not supported: "
            "mlx-lm ignores it, HF scales by it"
        )
    # HF takes mscale / mscale_all_dim only when both are set (else 0.1 ln(factor) + 1); mlx-lm takes
    # each one given (defaults 1 / 0): refused where the two attention scales differ.
    if hf_mscale(checked) != mlx_lm_mscale(checked):
        raise ConfigError(
            f"{where}: mscale={checked.get('mscale')!r} with mscale_all_dim={checked.get('mscale_all_dim')!r} "
            "is not supported: HF and mlx-lm scale attention differently unless both are set"
        )


def hf_mscale(cfg: Mapping[str, Any]) -> float:
    """HF's YaRN attention factor (without `attention_factor`, which is refused)."""
    factor, mscale, mscale_all = cfg["factor"], cfg.get("mscale"), cfg.get("mscale_all_dim")
    if mscale and mscale_all:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all)
    return yarn_mscale(factor, 1)


def mlx_lm_mscale(cfg: Mapping[str, Any]) -> float:
    """mlx-lm's YarnRoPE's attention factor."""
    factor = cfg["factor"]
    return yarn_mscale(factor, cfg.get("mscale", 1)) / yarn_mscale(factor, cfg.get("mscale_all_dim", 0))


def mlx_lm_args(args: ModelArgs) -> mlx_lm_gpt_oss.ModelArgs:
    """mlx-lm's ModelArgs for the checked `args`: what its MLPBlock reads."""
    moe: Experts = args.extra
    return mlx_lm_gpt_oss.ModelArgs(
        model_type=args.model_type,
        num_hidden_layers=args.num_hidden_layers,
        num_local_experts=moe.num_local_experts,
        num_experts_per_tok=moe.num_experts_per_tok,
        vocab_size=args.vocab_size,
        rms_norm_eps=args.rms_norm_eps,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        head_dim=args.head_dim,
        num_attention_heads=args.num_attention_heads,
        num_key_value_heads=args.num_key_value_heads,
        sliding_window=moe.sliding_window,
        rope_theta=args.rope_theta,
        rope_scaling=args.rope_scaling,
        layer_types=list(moe.layer_types),
    )


class UnroundedYarn(nn.Module):
    """HF's YaRN with `truncate: false` (OpenAI's reference): mlx-lm's YarnRoPE without the floor / ceil
    of the correction range; called as `rope(x, offset=...)` like mlx-lm's, for `flat.RopeAt`."""

    def __init__(self, dims: int, base: float, cfg: Mapping[str, Any]):
        super().__init__()
        factor, old_len = cfg["factor"], cfg["original_max_position_embeddings"]

        def correction_dim(rotations: float) -> float:
            return dims * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low = max(correction_dim(cfg.get("beta_fast") or 32), 0)
        high = min(correction_dim(cfg.get("beta_slow") or 1), dims - 1)
        high = high + 0.001 if high == low else high  # as HF and mlx-lm: no singular ramp
        ramp = mx.clip((mx.arange(dims // 2, dtype=mx.float32) - low) / (high - low), 0, 1)
        extra = base ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims)  # wavelengths / 2 pi
        inter = factor * extra
        mask = 1.0 - ramp  # 1: extrapolate (short wavelengths), 0: interpolate
        self._freqs = (inter * extra) / (inter * mask + extra * (1 - mask))  # mlx-lm's blend
        self.mscale = hf_mscale(cfg)  # read_yarn checked it is mlx-lm's too
        self.dims = dims

    def __call__(self, x: mx.array, offset: Any = 0) -> mx.array:
        if self.mscale != 1.0:
            x = x.at[..., : self.dims].multiply(self.mscale)
        return mx.fast.rope(x, self.dims, traditional=False, base=None, scale=1.0, offset=offset, freqs=self._freqs)


def yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def make_rope(args: ModelArgs) -> RopeAt:
    """mlx-lm's RoPE for `args` at per-token positions; HF's unrounded YaRN where truncate is false."""
    cfg = args.rope_scaling
    if cfg is not None and rope_type(cfg) == "yarn" and cfg.get("truncate") is False:
        return RopeAt(UnroundedYarn(args.head_dim, args.rope_theta, cfg))
    rope = initialize_rope(args.head_dim, base=args.rope_theta, traditional=False, scaling_config=cfg,
                           max_position_embeddings=args.max_position_embeddings)
    return RopeAt(rope)


def attention(args: ModelArgs, layer: int) -> Attention:
    """Biased projections and a learned sink logit per query head (`self_attn.sinks`)."""
    return Attention(args, layer, make_rope(args), 1.0 / math.sqrt(args.head_dim), bias=True, sinks=True)


def build(args: ModelArgs) -> DecoderModel:
    """The model `args` describes, with fresh (random) weights."""
    theirs = mlx_lm_args(args)
    layers = [
        PreNormBlock(attention(args, i), mlx_lm_gpt_oss.MLPBlock(theirs), args.hidden_size, args.rms_norm_eps)
        for i in range(args.num_hidden_layers)
    ]
    return DecoderModel(args, layers, nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps))


FUSED = re.compile(r"(.*\.mlp\.experts)\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?")


def sanitize(args: ModelArgs, weights: dict, source: str) -> tuple[ModelArgs, dict]:
    """HF's fused experts as mlx-lm's split ones (a checkpoint mlx-lm wrote passes as it is); HF's MXFP4
    blocks are one ConfigError saying how to convert them."""
    fused = {name: m for name in weights if (m := FUSED.fullmatch(name))}
    if not fused:
        return args, weights
    packed = sorted(name for name, m in fused.items() if m[3] in ("_blocks", "_scales"))
    if packed:
        raise ConfigError(
            f"{source}: {packed[0]} is OpenAI's MXFP4 packing, which kvlayout does not read; convert the "
            "checkpoint with `mlx_lm.convert --hf-path <it> --mlx-path <dir>` and run that directory"
        )
    weights = dict(weights)
    for name, m in fused.items():
        weights.update(split_expert(args, m[1], m[2], m[3], weights.pop(name), source))
    return args, weights


def split_expert(args: ModelArgs, prefix: str, proj: str, bias: str | None, w: mx.array,
                 source: str) -> dict[str, mx.array]:
    """One HF expert tensor as mlx-lm's: gate/up de-interleaved (even rows gate, odd up, as HF's
    `_apply_gate`), weights `x @ W` `[E, in, out]` transposed to `[E, out, in]`."""
    n, hidden, inter = args.extra.num_local_experts, args.hidden_size, args.intermediate_size
    out = 2 * inter if proj == "gate_up_proj" else hidden
    want = (n, out) if bias else (n, inter if proj == "down_proj" else hidden, out)
    if tuple(w.shape) != want:
        raise ConfigError(
            f"{source}: {prefix}.{proj}{bias or ''} has shape {tuple(w.shape)}, expected {want} "
            f"(num_local_experts, hidden_size, intermediate_size in config.json)"
        )
    suffix = "bias" if bias else "weight"
    if not bias:
        w = w.swapaxes(-1, -2)  # [E, out, in]
    if proj == "down_proj":
        return {f"{prefix}.down_proj.{suffix}": mx.contiguous(w)}
    gate, up = (w[..., ::2], w[..., 1::2]) if bias else (w[..., ::2, :], w[..., 1::2, :])
    return {f"{prefix}.gate_proj.{suffix}": mx.contiguous(gate), f"{prefix}.up_proj.{suffix}": mx.contiguous(up)}
