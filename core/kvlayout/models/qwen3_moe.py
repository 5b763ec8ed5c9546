"""Qwen3-MoE: Qwen3's attention, and on most layers mlx-lm's sparse mixture-of-experts MLP.

The attention is Qwen3's (`kvlayout.models.qwen3.attention`). mlx-lm's Qwen3-MoE
rotates with a plain `nn.RoPE(head_dim, base=rope_theta)` and ignores
`rope_scaling`, so a scaled RoPE is refused rather than applied where the
oracle would not apply it. A layer is sparse when it is not in
`mlp_only_layers`, there are experts, and `(i + 1) % decoder_sparse_step == 0`
(HF's and mlx-lm's rule); its MLP is mlx-lm's own `Qwen3MoeSparseMoeBlock`
(a router `mlp.gate` and the stacked experts `mlp.switch_mlp.{gate,up,down}_proj`
through `SwitchGLU`), the other layers Llama's dense MLP. The block works per
token on `[1, T, hidden]`, so a flat step of many sequences needs nothing of
its own. HF checkpoints store each expert apart (`mlp.experts.{e}.gate_proj`):
`sanitize` stacks them as mlx-lm's `Model.sanitize` does.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import attrs
import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import qwen3_moe as mlx_lm_qwen3_moe

from kvlayout.errors import ConfigError
from kvlayout.models import config_values as values
from kvlayout.models.args import ModelArgs, read_shape, refuse_set, rope_scaling
from kvlayout.models.flat import DecoderModel, PreNormBlock
from kvlayout.models.llama import MLP
from kvlayout.models.qwen3 import UNSUPPORTED, attention

MODEL_TYPES = ("qwen3_moe",)


@attrs.frozen
class Experts:
    """Qwen3-MoE's own config fields, checked."""

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    decoder_sparse_step: int
    mlp_only_layers: tuple[int, ...]

    def sparse(self, layer: int) -> bool:
        """Whether `layer`'s MLP is the experts (mlx-lm's Qwen3MoeDecoderLayer rule)."""
        return (
            layer not in self.mlp_only_layers
            and self.num_experts > 0
            and (layer + 1) % self.decoder_sparse_step == 0
        )


def read_args(cfg: Mapping[str, Any], source: str = "config.json") -> ModelArgs:
    refuse_set(cfg, source, UNSUPPORTED)
    # mlx-lm's Qwen3-MoE attention is a plain nn.RoPE: any scaling would be ignored there, so it is refused.
    rope_scaling(cfg, source, ("default",))
    shape = read_shape(cfg, source)
    return ModelArgs(
        model_type=cfg["model_type"],
        **shape,
        rope_theta=values.number(cfg, "rope_theta", source, 1000000.0),
        tie_word_embeddings=values.boolean(cfg, "tie_word_embeddings", source, False),
        windows=(0,) * shape["num_hidden_layers"],
        extra=read_experts(cfg, shape["num_hidden_layers"], source),
    )


def read_experts(cfg: Mapping[str, Any], n_layers: int, source: str) -> Experts:
    """The experts' keys, checked; HF's defaults where HF has one (sparse step 1, no dense-only layers)."""
    n_experts = values.integer(cfg, "num_experts", source, minimum=0)
    top_k = values.integer(cfg, "num_experts_per_tok", source)
    if n_experts and top_k > n_experts:
        raise ConfigError(
            f"{source}: num_experts_per_tok={top_k} is more than num_experts={n_experts}; "
            "a token is routed to at most every expert"
        )
    return Experts(
        num_experts=n_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=values.integer(cfg, "moe_intermediate_size", source),
        norm_topk_prob=values.boolean(cfg, "norm_topk_prob", source, False),
        decoder_sparse_step=values.integer(cfg, "decoder_sparse_step", source, default=1),
        mlp_only_layers=_layer_list(cfg, "mlp_only_layers", n_layers, source),
    )


def _layer_list(cfg: Mapping[str, Any], key: str, n_layers: int, source: str) -> tuple[int, ...]:
    """A list of layer indices (null: none), each in 0..n_layers-1."""
    value = cfg.get(key)
    if value is None:
        return ()
    ok = isinstance(value, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in value)
    if not ok or any(not 0 <= i < n_layers for i in value):
        raise ConfigError(
            f"{source}: {key}={value!r}: expected a list of layer indices in 0..{n_layers - 1} "
            f"(num_hidden_layers={n_layers})"
        )
    return tuple(value)


def mlx_lm_args(args: ModelArgs) -> mlx_lm_qwen3_moe.ModelArgs:
    """mlx-lm's ModelArgs for the checked `args`: what its sparse block reads."""
    moe: Experts = args.extra
    return mlx_lm_qwen3_moe.ModelArgs(
        model_type=args.model_type,
        hidden_size=args.hidden_size,
        num_hidden_layers=args.num_hidden_layers,
        intermediate_size=args.intermediate_size,
        num_attention_heads=args.num_attention_heads,
        num_experts=moe.num_experts,
        num_experts_per_tok=moe.num_experts_per_tok,
        decoder_sparse_step=moe.decoder_sparse_step,
        mlp_only_layers=list(moe.mlp_only_layers),
        moe_intermediate_size=moe.moe_intermediate_size,
        rms_norm_eps=args.rms_norm_eps,
        vocab_size=args.vocab_size,
        num_key_value_heads=args.num_key_value_heads,
        head_dim=args.head_dim,
        rope_theta=args.rope_theta,
        tie_word_embeddings=args.tie_word_embeddings,
        max_position_embeddings=args.max_position_embeddings,
        norm_topk_prob=moe.norm_topk_prob,
    )


def build(args: ModelArgs) -> DecoderModel:
    theirs = mlx_lm_args(args)

    def mlp(i: int) -> nn.Module:
        return mlx_lm_qwen3_moe.Qwen3MoeSparseMoeBlock(theirs) if args.extra.sparse(i) else MLP(args)

    layers = [
        PreNormBlock(attention(args, i), mlp(i), args.hidden_size, args.rms_norm_eps)
        for i in range(args.num_hidden_layers)
    ]
    return DecoderModel(args, layers, nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps))


EXPERT = re.compile(r"(model\.layers\.\d+\.mlp)\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


def sanitize(args: ModelArgs, weights: dict, source: str) -> tuple[ModelArgs, dict]:
    """HF's per-expert tensors stacked into mlx-lm's `switch_mlp.*.weight` `[E, out, in]` (a checkpoint
    mlx-lm wrote is stacked already and passes as it is); an expert missing is one ConfigError naming it."""
    groups: dict[str, str] = {}  # the stacked module -> its experts' tensor names, "{}" for the expert
    for name in weights:
        if m := EXPERT.fullmatch(name):
            groups[f"{m[1]}.switch_mlp.{m[3]}"] = f"{m[1]}.experts.{{}}.{m[3]}.weight"
    if not groups:
        return args, weights
    weights = dict(weights)
    for stacked, pattern in groups.items():
        names = [pattern.format(e) for e in range(args.extra.num_experts)]
        for name in names:
            if name not in weights:
                raise ConfigError(
                    f"{source}: missing tensor {name!r}; num_experts={args.extra.num_experts} in config.json"
                )
        weights[f"{stacked}.weight"] = mx.stack([weights.pop(n) for n in names])  # [E, out, in]
    return args, weights
