"""The phi3 rows of tests/models/families.py's CHECKPOINTS (mlx-lm config dicts and how each is written).

mlx-lm ignores `sliding_window`, which kvlayout (as Hugging Face) applies on every layer: the windowed
row's window (64) is longer than anything the tests run (a prompt of at most 34 tokens and the
tokens generated after it), so mlx-lm stays the oracle there, and `window=0` says the prompts do not
pass it. `mixed_bits` matches Phi-3's `o_proj` and `down_proj` (8-bit); the fused `qkv_proj` and
`gate_up_proj` match none of its names and take the default 4 bits. Phi-3's head_dim is
hidden / heads: hidden 128 over 4 heads gives 32, which the q8 KV-cache tests' groups of 32 divide.
"""

from __future__ import annotations

from tests.models.families import Checkpoint, mixed_bits

PHI3 = {
    "model_type": "phi3", "hidden_size": 128, "num_hidden_layers": 2, "intermediate_size": 128,
    "num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "vocab_size": 258,
    "max_position_embeddings": 4096, "original_max_position_embeddings": 4096, "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}
# head_dim 32, half of it rotated: 16 dims, 8 pairs, a factor each.
LONGROPE = {
    "partial_rotary_factor": 0.5, "max_position_embeddings": 4096, "original_max_position_embeddings": 64,
    "rope_scaling": {"type": "longrope", "short_factor": [1.0, 1.0, 1.25, 1.25, 1.5, 1.5, 2.0, 2.0],
                     "long_factor": [1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 2.75, 3.0]},
}

ROWS: dict[str, Checkpoint] = {
    "phi3": Checkpoint(PHI3),
    "phi3_partial_longrope": Checkpoint({**PHI3, **LONGROPE}),
    # The plain RoPE's path: three quarters of a head rotated (24 dims), interleaved, linearly scaled.
    # (mlx-lm's ModelArgs wants a long_factor in every rope_scaling, linear too, where nothing reads it.)
    "phi3_partial_linear_traditional": Checkpoint({**PHI3, "partial_rotary_factor": 0.75, "rope_traditional": True,
                                                   "rope_scaling": {"type": "linear", "factor": 2.0,
                                                                    "long_factor": [1.0] * 12}}),
    "phi3_window": Checkpoint({**PHI3, "sliding_window": 64}),
    "phi3_q4_mixed": Checkpoint(PHI3, bits=4, predicate=mixed_bits),
}
