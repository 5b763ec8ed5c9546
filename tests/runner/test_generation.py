"""Greedy outputs are the same under mlx:seq, mlx:cell and a cache-free forward (fp32 storage)."""

from __future__ import annotations

import numpy as np
import pytest

import kvlayout
from kvlayout.runner import job
from tests.runner.conftest import QUESTIONS, SYSTEM, make_config, oracle_outputs, token_ids


@pytest.fixture(scope="module", autouse=True)
def _layouts_installed():
    for kind in ("seq", "cell"):
        kvlayout.resolve("mlx", kind)  # the real plugins, through the registry


def _both(loaded, model_dir, **kw):
    results = {
        layout: job.run(make_config(model_dir, layout, **kw), loaded=loaded) for layout in ("mlx:seq", "mlx:cell")
    }
    return results["mlx:seq"], results["mlx:cell"]


def test_greedy_outputs_equal_the_cache_free_forward_under_both_layouts_with_forks(tiny_loaded, tiny_dir):
    seq, cell = _both(tiny_loaded, tiny_dir)
    want = oracle_outputs(tiny_loaded, make_config(tiny_dir))
    assert token_ids(seq) == want
    assert token_ids(cell) == want
    # The n=2 forks of each prompt shared its cells instead of copying them.
    assert cell.stats.peak_cells < cell.stats.peak_tokens
    assert cell.stats.max_batch > 1 and seq.stats.max_batch == 1


@pytest.mark.parametrize("chunk", [5, 64])
def test_ring_layers_from_sliding_window_match_the_cache_free_forward(ring_loaded, ring_dir, chunk):
    # Prompts and outputs run well past the window of 8: chunks of 5 wrap the ring
    # mid-prompt; chunks of 64 exceed the window (seq steps are then capped at it).
    seq, cell = _both(ring_loaded, ring_dir, engine={"prefill_chunk": chunk})
    want = oracle_outputs(ring_loaded, make_config(ring_dir))
    assert token_ids(seq) == want
    assert token_ids(cell) == want


def test_a_tiny_capacity_forces_preemption_without_changing_outputs(tiny_loaded, tiny_dir):
    requests = [{"prompt": SYSTEM + q, "max_tokens": 16, "n": 2} for q in QUESTIONS]
    need = max(len(tiny_loaded[2].encode(r["prompt"])) + 2 * 16 for r in requests)
    cfg = make_config(tiny_dir, "mlx:cell", requests=requests, cache={"capacity": need})
    cell = job.run(cfg, loaded=tiny_loaded)
    assert cell.stats.preemptions > 0
    assert cell.stats.peak_cells <= need
    assert token_ids(cell) == oracle_outputs(tiny_loaded, cfg)
    assert all(s.finish_reason in ("length", "stop") for samples in cell.outputs for s in samples)


def test_max_seqs_bounds_the_batch_and_splits_a_wide_request(tiny_loaded, tiny_dir):
    requests = [{"prompt": SYSTEM + QUESTIONS[0], "max_tokens": 6, "n": 5}, {"prompt_ids": [1, 2, 3], "max_tokens": 6}]
    cfg = make_config(tiny_dir, "mlx:cell", requests=requests, cache={"max_seqs": 2})
    cell = job.run(cfg, loaded=tiny_loaded)
    assert cell.stats.max_batch <= 2
    assert [len(s) for s in cell.outputs] == [5, 1]
    assert token_ids(cell) == token_ids(job.run(cfg.with_layout("mlx:seq"), loaded=tiny_loaded))


def test_sampling_is_seeded_per_sample_so_batching_does_not_change_it(tiny_loaded, tiny_dir):
    sampling = {"temperature": 0.9, "top_p": 0.9, "seed": 5}
    seq, cell = _both(tiny_loaded, tiny_dir, sampling=sampling)
    assert token_ids(seq) == token_ids(cell)
    # The two samples of a request draw from different generators.
    assert any(samples[0] != samples[1] for samples in token_ids(cell))
    again = job.run(make_config(tiny_dir, "mlx:cell", sampling={**sampling, "seed": 6}), loaded=tiny_loaded)
    assert token_ids(again) != token_ids(cell)


def test_every_request_comes_back_once_in_config_order(tiny_loaded, tiny_dir):
    requests = [{"prompt_ids": [10 + i] * (3 + 7 * i), "max_tokens": 2 + i, "n": 1 + i % 3} for i in range(7)]
    cfg = make_config(tiny_dir, "mlx:cell", requests=requests, cache={"capacity": 64}, engine={"prefill_chunk": 8})
    cell = job.run(cfg, loaded=tiny_loaded)
    assert [r.index for r in cell.requests] == list(range(7))
    assert [len(s) for s in cell.outputs] == [1 + i % 3 for i in range(7)]
    for i, samples in enumerate(cell.outputs):
        for s in samples:
            assert len(s.token_ids) == 2 + i or s.finish_reason == "stop"
    assert token_ids(cell) == token_ids(job.run(cfg.with_layout("mlx:seq"), loaded=tiny_loaded))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_workloads_under_pressure_match_the_seq_layout(tiny_loaded, tiny_dir, seed):
    """Tight capacity, few ids and small chunks together: preemption mid-prefill and mid-decode."""
    rng = np.random.default_rng(seed)
    requests = [
        {
            "prompt_ids": [int(t) for t in rng.integers(0, 256, int(rng.integers(1, 30)))],
            "max_tokens": int(rng.integers(4, 16)),
            "n": int(rng.integers(1, 4)),
        }
        for _ in range(6)
    ]
    need = max(len(r["prompt_ids"]) + r["n"] * r["max_tokens"] for r in requests)
    cfg = make_config(
        tiny_dir,
        "mlx:cell",
        requests=requests,
        cache={"capacity": need + int(rng.integers(0, 4)), "max_seqs": int(rng.integers(4, 9))},
        engine={"prefill_chunk": int(rng.integers(1, 16))},
    )
    cell = job.run(cfg, loaded=tiny_loaded)
    seq = job.run(cfg.with_layout("mlx:seq"), loaded=tiny_loaded)
    assert token_ids(cell) == token_ids(seq)
    assert [len(s) for s in cell.outputs] == [r["n"] for r in requests]
    assert cell.stats.preemptions > 0  # the workload really was under pressure
