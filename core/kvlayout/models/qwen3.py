"""Qwen3: the Llama block with an RMSNorm over each query and key head before RoPE, no biases.

What differs from Llama is the attention's per-head `q_norm` / `k_norm`
(mlx-lm's `qwen3.Attention`); RoPE and its scaling are mlx-lm's
`initialize_rope`, applied at per-token positions (`flat.RopeAt`), and the
MLP is Llama's. Qwen3-MoE (`qwen3_moe`) shares this attention.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import mlx.nn as nn
from mlx_lm.models.rope_utils import initialize_rope

from kvlayout.models import config_values as values
from kvlayout.models.args import ModelArgs, read_shape, refuse_set, rope_scaling
from kvlayout.models.flat import Attention, DecoderModel, PreNormBlock, RopeAt
from kvlayout.models.llama import MLP

MODEL_TYPES = ("qwen3",)

# The rope_scaling types mlx-lm's initialize_rope applies position by position ("dynamic" rescales by
# the sequence's length, which a flat step of many sequences does not have), and the keys each needs.
ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")
ROPE_NEEDS = {
    "linear": ("factor",),
    "llama3": ("factor",),
    "yarn": ("factor",),
    "longrope": ("original_max_position_embeddings", "short_factor", "long_factor"),
}
# Values Qwen3 configs carry whose other settings kvlayout (and mlx-lm) does not implement.
UNSUPPORTED = {"use_sliding_window": False, "attention_bias": False}


def read_args(cfg: Mapping[str, Any], source: str = "config.json") -> ModelArgs:
    refuse_set(cfg, source, UNSUPPORTED)
    shape = read_shape(cfg, source)
    return ModelArgs(
        model_type=cfg["model_type"],
        **shape,
        rope_theta=values.number(cfg, "rope_theta", source, 1000000.0),
        rope_scaling=rope_scaling(cfg, source, ROPE_TYPES, ROPE_NEEDS),
        tie_word_embeddings=values.boolean(cfg, "tie_word_embeddings", source, False),
        windows=(0,) * shape["num_hidden_layers"],
    )


def make_rope(args: ModelArgs, base: float | None = None, scaling: dict | None = None) -> RopeAt:
    """mlx-lm's RoPE for these args (its base and scaling unless given) at per-token positions."""
    rope = initialize_rope(
        args.head_dim,
        base=args.rope_theta if base is None else base,
        traditional=False,
        scaling_config=args.rope_scaling if scaling is None else scaling,
        max_position_embeddings=args.max_position_embeddings,
    )
    return RopeAt(rope)


def attention(args: ModelArgs, layer: int) -> Attention:
    """Llama's attention with each query and key head RMS-normed before RoPE, no biases."""
    return Attention(args, layer, make_rope(args), args.head_dim**-0.5, norm=nn.RMSNorm)


def build(args: ModelArgs) -> DecoderModel:
    layers = [
        PreNormBlock(attention(args, i), MLP(args), args.hidden_size, args.rms_norm_eps)
        for i in range(args.num_hidden_layers)
    ]
    return DecoderModel(args, layers, nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps))
