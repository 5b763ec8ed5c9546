"""The gpt_oss rows of tests/models/families.py's CHECKPOINTS (mlx-lm config dicts and how each is written).

head_dim 32, not 16: test_families.py's quantized-KV tests pack K/V in groups of 32.
Four layers alternating sliding (window 5) and full, so the 21-token prompts pass the window on two
of them. mlx-lm initialises the attention sinks as zeros; the rows write random ones (`random_sinks`),
so every family test runs them. The YaRN row says `truncate: true`, where
mlx-lm (which always floors / ceils the correction range) and HF agree; `truncate: false` is HF's
unrounded range, which kvlayout follows and mlx-lm does not (tested against HF's formula there).
`gpt_oss_q4` packs the model 4-bit with mlx-lm's own gpt_oss quant_predicate (the router 8-bit in
groups of 64), the experts' SwitchLinear layers included.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from tests.models.families import Checkpoint

GPT_OSS = {
    "model_type": "gpt_oss", "hidden_size": 64, "num_hidden_layers": 4, "intermediate_size": 64,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "rms_norm_eps": 1e-5,
    "vocab_size": 258, "max_position_embeddings": 2048, "rope_theta": 150000, "rope_scaling": None,
    "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 5,
    "layer_types": ["sliding_attention", "full_attention"] * 2,
}
WINDOW = GPT_OSS["sliding_window"]
YARN = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "original_max_position_embeddings": 64, "truncate": True}


def router_8bit(path: str, module: nn.Module) -> bool | dict:
    """mlx-lm's gpt_oss `Model.quant_predicate`: the router 8-bit in groups of 64, the rest the default."""
    if path.endswith("router"):
        return {"group_size": 64, "bits": 8}
    return True


def random_sinks(model: nn.Module) -> None:
    """Seeded random attention sinks [H_q] on every layer, in place of mlx-lm's initial zeros."""
    keys = mx.random.split(mx.random.key(3), len(model.model.layers))
    for layer, key in zip(model.model.layers, keys):
        layer.self_attn.sinks = 2.0 * mx.random.normal(layer.self_attn.sinks.shape, key=key)  # [H_q]


ROWS: dict[str, Checkpoint] = {
    "gpt_oss": Checkpoint(GPT_OSS, window=WINDOW, tweak=random_sinks),
    "gpt_oss_yarn": Checkpoint({**GPT_OSS, "rope_scaling": YARN}, window=WINDOW, tweak=random_sinks),
    "gpt_oss_q4": Checkpoint(GPT_OSS, bits=4, predicate=router_8bit, window=WINDOW, tweak=random_sinks),
}
