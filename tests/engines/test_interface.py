"""Both engines behind one interface (engines.interface.Engine), driven as a server would drive them.

The oracles: the cache-free forward for greedy tokens, and an uninterrupted
`run()` of a fresh engine for everything else (sampled tokens, step counts).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import kvlayout
from kvlayout.engines import Engine
from kvlayout.errors import StateError
from tests.engines.conftest import engine_for, outputs, requests_for
from tests.runner.conftest import oracle_greedy

KINDS = ["seq", "cell"]


def run_to_the_end(kind, tiny, temperature=0.0):
    """A fresh engine given every request at once and run: (requests, Setup)."""
    reqs = requests_for(tiny)
    setup = engine_for(kind, tiny, temperature=temperature)
    setup.engine.add(reqs)
    assert setup.engine.run() is True
    return reqs, setup


@pytest.mark.parametrize("kind", KINDS)
def test_a_driver_calling_only_add_and_step_gets_what_run_gets_and_the_cache_free_tokens(kind, tiny):
    by_run, ran = run_to_the_end(kind, tiny)
    by_steps = requests_for(tiny)
    setup = engine_for(kind, tiny)
    assert isinstance(setup.engine, Engine)
    setup.engine.add(by_steps)
    steps = 0
    while setup.engine.step():
        steps += 1
    assert outputs(by_steps) == outputs(by_run)
    assert steps == setup.stats.steps == ran.stats.steps  # one forward a step
    assert not setup.engine.has_work and setup.engine.step() is False
    model, _, tok = tiny
    for r in by_steps:
        want, reason = oracle_greedy(model, r.prompt, r.max_tokens, frozenset(tok.eos_ids))
        assert outputs([r]) == [[(want, reason)] * r.n]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("when", ["while the first decodes", "after the engine went idle"])
def test_requests_added_between_steps_generate_what_they_generate_added_at_once(kind, tiny, when):
    at_once, _ = run_to_the_end(kind, tiny, temperature=0.8)
    later = requests_for(tiny)
    setup = engine_for(kind, tiny, temperature=0.8)
    setup.engine.add(later[:1])
    if when == "while the first decodes":
        while not later[0].samples[0].generated:
            assert setup.engine.step()
        assert setup.engine.has_work
    else:
        while setup.engine.step():
            pass
    setup.engine.add(later[1:])
    assert setup.engine.has_work
    while setup.engine.step():
        pass
    assert outputs(later) == outputs(at_once)
    assert any(r.samples[0].generated != r.samples[1].generated for r in later)  # really sampled


def copy_samples(src, dst) -> None:
    """What a resumed run reads back into fresh requests: every sample's tokens, finish and generator."""
    for r, r2 in zip(src, dst, strict=True):
        for s, s2 in zip(r.samples, r2.samples, strict=True):
            s2.generated, s2.finish_reason, s2.error = list(s.generated), s.finish_reason, s.error
            s2.rng.bit_generator.state = s.rng.bit_generator.state


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("part", [0.02, 0.3, 0.55, 0.9])  # of the run's steps: from mid-prefill to the last sample
def test_state_and_the_saved_cache_restored_into_a_fresh_engine_continue_the_run_exactly(kind, tiny, tmp_path, part):
    full, ran = run_to_the_end(kind, tiny, temperature=0.8)
    k = max(1, int(part * ran.stats.steps))
    first_reqs = requests_for(tiny)
    first = engine_for(kind, tiny, temperature=0.8)
    first.engine.add(first_reqs)
    for _ in range(k):
        assert first.engine.step()
    state = first.engine.state()
    assert json.loads(json.dumps(state)) == state  # plain JSON
    first.cache.save(tmp_path / "cache.safetensors")

    # What another process would read back: fresh requests holding the samples as they stood, the cache.
    again_reqs = requests_for(tiny)
    copy_samples(first_reqs, again_reqs)
    again = engine_for(kind, tiny, cache=kvlayout.load(tmp_path / "cache.safetensors"), temperature=0.8)
    again.engine.restore(json.loads(json.dumps(state)), again_reqs)
    assert again.engine.run() is True
    assert outputs(again_reqs) == outputs(full)
    assert first.stats.steps + again.stats.steps == ran.stats.steps  # no step redone, none skipped


@pytest.mark.parametrize("kind", KINDS)
def test_restore_refuses_another_engines_state_or_one_its_cache_disagrees_with_and_changes_nothing(kind, tiny):
    other = "cell" if kind == "seq" else "seq"
    donors = {}
    for name in (kind, other):
        donors[name] = engine_for(name, tiny)
        donors[name].engine.add(requests_for(tiny))
        for _ in range(3):  # mid-prefill: the cache holds part of the first prompt
            donors[name].engine.step()
    fresh_reqs = requests_for(tiny)
    fresh = engine_for(kind, tiny)  # its cache is empty, unlike the one saved with the donor's state
    fresh.engine.add(fresh_reqs)
    before = fresh.engine.state()
    with pytest.raises(StateError, match=f"saved by the {other} engine, resumed by another"):
        fresh.engine.restore(donors[other].engine.state(), requests_for(tiny))
    with pytest.raises(StateError, match=r"holds 0 (position|token)\(s\).*, the run says [1-9]"):
        fresh.engine.restore(donors[kind].engine.state(), requests_for(tiny))
    assert fresh.engine.state() == before
    assert fresh.engine.run() is True  # the work it had is still queued, and comes out as a clean run's
    assert outputs(fresh_reqs) == outputs(run_to_the_end(kind, tiny)[0])


def test_the_engines_import_nothing_from_the_runner():
    code = "import sys, kvlayout.engines; print(sorted(m for m in sys.modules if m.startswith('kvlayout.runner')))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ, check=True)
    assert done.stdout.strip() == "[]"
