"""A forward that raises in layer k of n: the runner aborts the step and carries on.

Greedy outputs of every request the failure did not doom are token for token
those of a run without the failure, on both layouts.
"""

from __future__ import annotations

import pytest

from kvlayout.models.loading import load_model
from kvlayout.models.presets import build_preset
from kvlayout.runner import job
from tests.runner.conftest import QUESTIONS, SYSTEM, make_config, token_ids
from tests.runner.flaky import FlakyModel
from tests.runner.flaky import with_model as loaded_with


@pytest.fixture(scope="module")
def deep():
    """The tiny preset with 4 layers, so a failure in layer 2 leaves two layers written."""
    model, args, tok = build_preset("tiny", num_hidden_layers=4)
    return model, args, tok, "preset:tiny-4"


@pytest.fixture(scope="module")
def ring(ring_dir):
    """Layer 0 slides over a window of 8 (a ring on the seq layout), layer 1 is full."""
    model, args, tok = load_model(ring_dir)
    return model, args, tok, str(ring_dir)


def requests():
    return [{"prompt": SYSTEM + q, "max_tokens": 6, "n": 2} for q in QUESTIONS]


_clean: dict = {}


def clean_run(tiny_dir, layout, which, loaded, chunk):
    """The run without failures, once per (layout, model, chunk)."""
    key = (layout, which, chunk)
    if key not in _clean:
        cfg = make_config(tiny_dir, layout, requests=requests(), engine={"prefill_chunk": chunk})
        _clean[key] = job.run(cfg, loaded=loaded)
    return _clean[key]


# Layer 0: the forward fails before any layer wrote; None: after every layer wrote (the LM head).
CASES = [("deep", 2), ("ring", 1), ("deep", 0), ("ring", None)]


@pytest.mark.parametrize("layout", ["mlx:cell", "mlx:seq"])
@pytest.mark.parametrize("which, k", CASES)
@pytest.mark.parametrize("fail_at", [2, 9])  # mid-prefill, and a step decoding several sequences
def test_a_forward_failing_once_changes_no_output(request, tiny_dir, layout, which, k, fail_at):
    loaded = request.getfixturevalue(which)
    cfg = make_config(tiny_dir, layout, requests=requests(), engine={"prefill_chunk": 16})
    clean = clean_run(tiny_dir, layout, which, loaded, 16)
    flaky = FlakyModel(loaded[0], k, fail_calls=[fail_at])
    result = job.run(cfg, loaded=loaded_with(loaded, flaky))
    assert flaky.layer.raised == 1
    assert result.stats.failed_forwards == 1
    assert token_ids(result) == token_ids(clean)
    assert all(s.finish_reason in ("stop", "length") for samples in result.outputs for s in samples)


@pytest.mark.parametrize("layout", ["mlx:cell", "mlx:seq"])
@pytest.mark.parametrize("which, k", CASES)
def test_a_request_that_always_fails_finishes_with_an_error_and_the_others_carry_on(
    request, tiny_dir, layout, which, k
):
    loaded = request.getfixturevalue(which)
    reqs = requests()
    reqs.insert(1, {"prompt": SYSTEM + "Q: what is ~?\nA:", "max_tokens": 6, "n": 2})
    cfg = make_config(tiny_dir, layout, requests=reqs, engine={"prefill_chunk": 16})
    clean = clean_run(tiny_dir, layout, which, loaded, 16)
    flaky = FlakyModel(loaded[0], k, poison=True)
    result = job.run(cfg, loaded=loaded_with(loaded, flaky))
    doomed = result.outputs[1]
    assert [s.finish_reason for s in doomed] == ["error", "error"]
    message = "Boom: the LM head failed on purpose" if k is None else f"Boom: layer {k} failed on purpose"
    assert all(s.token_ids == [] and s.error == message for s in doomed)
    assert result.to_json()["requests"][1]["samples"][0]["error"] == doomed[0].error
    others = [samples for i, samples in enumerate(token_ids(result)) if i != 1]
    assert others == token_ids(clean)
    assert flaky.layer.raised >= 2  # the failure and its retry


def test_the_cell_engine_frees_the_failed_sequences_cells(tiny_dir, deep):
    reqs = [{"prompt": SYSTEM + "Q: what is ~?\nA:", "max_tokens": 4, "n": 3}]
    cfg = make_config(tiny_dir, "mlx:cell", requests=reqs)
    prepared = job.prepare(cfg, loaded=loaded_with(deep, FlakyModel(deep[0], 2, poison=True)))
    result = prepared.generate()
    assert [s.finish_reason for s in result.outputs[0]] == ["error"] * 3
    bc = prepared.cache.as_batch_control()
    assert bc.free_cells == bc.capacity and bc.used_end == 0
