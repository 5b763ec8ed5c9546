"""The sampler: greedy, temperature and top-p, reproducible per sample."""

from __future__ import annotations

import numpy as np

from kvlayout.engines.sampling import sample_rng, sample_token


def test_temperature_zero_is_argmax_and_draws_nothing():
    rng = sample_rng(0, 0, 0)
    state = rng.bit_generator.state
    assert sample_token(np.array([0.1, 3.0, 2.9]), 0.0, 1.0, rng) == 1
    assert rng.bit_generator.state == state


def test_a_tiny_top_p_keeps_only_the_most_likely_token():
    logits = np.random.default_rng(1).normal(size=50)
    rng = sample_rng(0, 0, 0)
    assert {sample_token(logits, 1.5, 1e-9, rng) for _ in range(50)} == {int(np.argmax(logits))}


def test_samples_follow_the_softmax_and_are_seeded_per_request_and_sample():
    logits = np.log(np.array([0.5, 0.3, 0.2]))
    draws = [sample_token(logits, 1.0, 1.0, sample_rng(3, 0, 0)) for _ in range(3)]
    assert len(set(draws)) == 1  # same (seed, request, sample): same token
    rng = sample_rng(3, 1, 0)
    counts = np.bincount([sample_token(logits, 1.0, 1.0, rng) for _ in range(4000)], minlength=3) / 4000
    np.testing.assert_allclose(counts, [0.5, 0.3, 0.2], atol=0.03)


def test_top_p_drops_the_tail():
    logits = np.log(np.array([0.6, 0.3, 0.1]))
    rng = sample_rng(0, 0, 0)
    assert {sample_token(logits, 1.0, 0.8, rng) for _ in range(300)} == {0, 1}
