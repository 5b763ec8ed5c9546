"""The gemma3 rows of tests/models/families.py's CHECKPOINTS (mlx-lm config dicts and how each is written).

Six layers, pattern 3: layers 2 and 5 global (rope_theta, rope_scaling), the others sliding over 6
keys with the local RoPE base, so the 21-token prompts pass the window on four layers. A scaled
RoPE on the global layers must not reach the local ones (the linear row). The multimodal `gemma3`
row is mlx-lm's `gemma3.Model`: its text half under `language_model.`, the vocabulary at the top
level and the heads left to mlx-lm's defaults (8 / 4); mlx-lm fills them into `text_config`, and
save_config writes them there.
"""

from __future__ import annotations

from tests.models.families import Checkpoint, mixed_bits

GEMMA3_TEXT = {
    "model_type": "gemma3_text", "hidden_size": 64, "num_hidden_layers": 6, "intermediate_size": 128,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "rms_norm_eps": 1e-6,
    "vocab_size": 258, "max_position_embeddings": 2048, "query_pre_attn_scalar": 32,
    "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "sliding_window": 6, "sliding_window_pattern": 3,
    "rope_scaling": None,
}
WINDOW = GEMMA3_TEXT["sliding_window"]
# The multimodal config's text half: heads, vocabulary and the local base left to the defaults; a
# query_pre_attn_scalar other than head_dim, so the attention scale is told apart from head_dim**-0.5.
TEXT_CONFIG = {**{k: v for k, v in GEMMA3_TEXT.items()
                  if k not in ("num_attention_heads", "num_key_value_heads", "vocab_size", "rope_local_base_freq")},
               "query_pre_attn_scalar": 24}

ROWS: dict[str, Checkpoint] = {
    "gemma3_text": Checkpoint(GEMMA3_TEXT, window=WINDOW),
    "gemma3_text_tied": Checkpoint(GEMMA3_TEXT, drop=("lm_head",), window=WINDOW),
    "gemma3_text_linear_rope": Checkpoint({**GEMMA3_TEXT, "rope_scaling": {"rope_type": "linear", "factor": 8.0}},
                                          window=WINDOW),
    "gemma3_text_q4_mixed": Checkpoint(GEMMA3_TEXT, bits=4, predicate=mixed_bits, window=WINDOW),
    # A copy: mlx-lm fills its defaults into the text_config it is given.
    "gemma3": Checkpoint({"model_type": "gemma3", "vocab_size": 258, "text_config": dict(TEXT_CONFIG)}, window=WINDOW),
    # The quantization section's module paths under language_model.
    "gemma3_q4_mixed": Checkpoint({"model_type": "gemma3", "vocab_size": 258, "text_config": dict(TEXT_CONFIG)},
                                  bits=4, predicate=mixed_bits, window=WINDOW),
}
