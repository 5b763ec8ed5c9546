"""The qwen3_moe rows of tests/models/families.py's CHECKPOINTS (mlx-lm config dicts and how each is written)."""

from __future__ import annotations

import mlx.nn as nn

from tests.models.families import Checkpoint, mixed_bits

# head_dim 32, not 16: test_families.py's quantized-KV tests pack K/V in groups of 32.
QWEN3_MOE = {
    "model_type": "qwen3_moe", "hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 128,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "rms_norm_eps": 1e-6,
    "vocab_size": 258, "max_position_embeddings": 2048, "rope_theta": 1000000.0, "tie_word_embeddings": False,
    "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "decoder_sparse_step": 1,
    "mlp_only_layers": [], "norm_topk_prob": True,
}


def moe_mixed_bits(path: str, module: nn.Module) -> bool | dict:
    """mlx-lm's own Qwen3-MoE quant_predicate (the router `mlp.gate` 8-bit in groups of 64) over
    mixed_bits (v/o and down projections, the experts' included, 8-bit)."""
    if path.endswith("mlp.gate"):
        return {"group_size": 64, "bits": 8}
    return mixed_bits(path, module)


ROWS: dict[str, Checkpoint] = {
    "qwen3_moe": Checkpoint(QWEN3_MOE),
    "qwen3_moe_dense_layer": Checkpoint({**QWEN3_MOE, "mlp_only_layers": [0], "norm_topk_prob": False}),
    "qwen3_moe_q4_mixed": Checkpoint(QWEN3_MOE, bits=4, predicate=moe_mixed_bits),
}
