"""The model's numerics against mlx-lm, loaded from the same directory (the independent oracle)."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx_lm.utils as mlx_lm_utils  # the independent oracle; a test extra, never skipped
import numpy as np
import pytest

from kvlayout.models.loading import load_model
from kvlayout.models.presets import build_preset, write_preset
from tests.runner.conftest import NoCache

FAMILIES = {
    "llama_untied": {},
    "llama_tied_bias": {"tie_word_embeddings": True, "attention_bias": True, "mlp_bias": True},
    "qwen2": {"model_type": "qwen2", "tie_word_embeddings": True, "head_dim": None, "rope_theta": 1e6},
    "mistral": {"model_type": "mistral", "num_key_value_heads": 1},
    "llama_sliding": {"sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]},
    "llama3_rope": {
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        }
    },
}


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_equal_mlx_lm_from_the_same_directory(family, tmp_path):
    model_dir = write_preset(tmp_path / family, "tiny", seed=3, **FAMILIES[family])
    ours, args, _ = load_model(model_dir)
    theirs, _ = mlx_lm_utils.load_model(Path(model_dir))
    ids = [int(t) for t in np.random.default_rng(0).integers(0, 256, 40)]

    got = ours(ids, range(len(ids)), NoCache(args.windows))  # [T, V]
    want = theirs(mx.array(ids)[None])[0]  # [T, V]
    assert got.shape == want.shape
    assert mx.abs(got - want).max().item() < 1e-4


def test_a_flat_step_of_two_sequences_equals_each_alone(tiny_loaded):
    """Per-token positions: one forward over two sequences at unrelated positions."""
    model, args, _, _ = tiny_loaded
    a, b = list(range(30, 45)), list(range(100, 107))

    class TwoSeqs:
        """A block-diagonal causal mask: query i sees key j of its own sequence, no newer."""

        def update_and_fetch(self, layer, positions, k, v):
            seq = np.array([0] * len(a) + [1] * len(b))
            pos = np.asarray(positions)
            mask = (seq[:, None] == seq[None, :]) & (pos[None, :] <= pos[:, None])
            from kvlayout.spec import AttendSpec, MaskKind

            return AttendSpec(k, v, MaskKind.EXPLICIT, mx.array(mask)[None, None])

    both = model(a + b, [*range(len(a)), *range(len(b))], TwoSeqs())
    alone_a = model(a, range(len(a)), NoCache(args.windows))
    alone_b = model(b, range(len(b)), NoCache(args.windows))
    assert mx.abs(both[: len(a)] - alone_a).max().item() < 1e-5
    assert mx.abs(both[len(a) :] - alone_b).max().item() < 1e-5


def test_sliding_window_becomes_ring_layers_in_the_cache_config(ring_loaded):
    _, args, _, _ = ring_loaded
    kinds = [(c.policy.kind, c.policy.window) for c in args.layer_configs()]
    assert kinds == [("ring", 8), ("flat", 0)]


def test_qwen2_slides_only_with_use_sliding_window():
    from kvlayout.models.architectures import read_args
    from kvlayout.models.presets import preset_config

    base = preset_config("tiny", model_type="qwen2", sliding_window=16, max_window_layers=1)
    assert read_args(base).windows == (0, 0)
    assert read_args({**base, "use_sliding_window": True}).windows == (0, 16)
    mistral = preset_config("tiny", model_type="mistral", sliding_window=16)
    assert read_args(mistral).windows == (16, 16)


def test_the_model_dtype_is_the_compute_dtype_even_when_the_embedding_is_packed():
    """The runner picks the K/V dtype from it; a quantized embedding's weight is uint32 words."""
    model, _, _ = build_preset("tiny")
    nn.quantize(model, 32, 4, class_predicate=lambda path, _: path == "model.embed_tokens")
    assert model.model.embed_tokens.weight.dtype == mx.uint32
    assert model.dtype == mx.float32
    model.set_dtype(mx.bfloat16)
    assert model.dtype == mx.bfloat16 and model.model.embed_tokens.weight.dtype == mx.uint32
