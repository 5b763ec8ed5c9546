"""Drawing ahead (engines.ahead) at the edges a driver sees between steps: cancel, run's answer,
and the peaks a run reports, against the same engine with pipeline=False (the host path)."""

from __future__ import annotations

import pytest

from tests.engines.conftest import outputs
from tests.engines.test_pipeline import KINDS, an_eos, engine, requests
from tests.engines.test_stopping import Heard


def _steps_then(kind, tiny, pipeline, steps, eos=()):
    heard = Heard()
    e, cache = engine(kind, tiny, pipeline, eos=eos, on_token=heard)
    reqs = requests(tiny, max_tokens=(9,), n=(1,))
    e.add(reqs)
    for _ in range(steps):
        e.step()
    return e, cache, reqs, heard


@pytest.mark.parametrize("kind", KINDS)
def test_cancel_between_steps_keeps_the_token_the_host_path_already_drew(kind, tiny):
    """Cancel after the same number of steps: the host path's sample holds the token its last
    step drew, so drawn ahead, cancel reads the token in flight first: the sample and what
    on_token heard are the host path's."""
    probe, _, probe_reqs, _ = _steps_then(kind, tiny, True, 0)
    steps = 0
    while not (_in_flight(kind, probe) and probe_reqs[0].samples[0].generated):
        probe.step()
        steps += 1  # the first step after which a decode's token is in flight
    results = {}
    for pipeline in (False, True):
        e, _, reqs, heard = _steps_then(kind, tiny, pipeline, steps)
        e.cancel(reqs[0])
        results[pipeline] = (outputs(reqs), dict(heard.events))
    assert results[True] == results[False]


@pytest.mark.parametrize("kind", KINDS)
def test_cancel_after_an_eos_is_drawn_ends_with_stop_as_the_host_path(kind, tiny):
    """The host path read the EOS in the step that drew it: the sample ended "stop" and cancel
    leaves it; drawn ahead, the EOS is still in flight when cancel comes, and must end it "stop" too."""
    eos = {an_eos(kind, tiny, at=3)}
    results = {}
    for pipeline in (False, True):
        # prompt steps + the decode steps that draw generated[0..3] (the EOS at index 3)
        e, _, reqs, heard = _steps_then(kind, tiny, pipeline, 0, eos=eos)
        while len(reqs[0].samples[0].generated) + (1 if _in_flight(kind, e) else 0) < 4 and e.has_work:
            e.step()
        e.cancel(reqs[0])
        results[pipeline] = outputs(reqs)
    assert results[False][0][0][1] == "stop"
    assert results[True] == results[False]


def _in_flight(kind, e):
    if kind == "seq":
        return e.generating is not None and e.generating.drawn is not None
    return any(s.drawn is not None for s in e.scheduler.running)


@pytest.mark.parametrize("kind", KINDS)
def test_run_reports_complete_when_stop_is_asked_only_because_a_finishing_token_is_in_flight(kind, tiny):
    """Engine.run: True when no work is left, False only when stop() ended it with work left.
    A stop() that allows exactly the host path's steps: the host path never asks it again and
    returns True; drawn ahead, the EOS is still in flight, stop() is asked once more, and run
    settles, which finishes every sample: True as well."""
    eos = {an_eos(kind, tiny, at=3)}
    host, _ = engine(kind, tiny, False, eos=eos)
    host_reqs = requests(tiny, max_tokens=(9,), n=(1,))
    host.add(host_reqs)
    calls = []
    assert host.run(lambda: calls.append(1) is None and False) is True
    n = len(calls)

    e, _ = engine(kind, tiny, True, eos=eos)
    reqs = requests(tiny, max_tokens=(9,), n=(1,))
    e.add(reqs)
    asked = []

    def stop():
        asked.append(1)
        return len(asked) > n

    complete = e.run(stop)
    assert outputs(reqs) == outputs(host_reqs)
    assert not e.has_work  # every sample finished...
    assert complete is True  # ...so run() says so, as the host path's did


@pytest.mark.parametrize("kind", KINDS)
def test_peak_cells_and_tokens_are_the_host_paths_when_an_eos_ends_a_sample(kind, tiny):
    """The speculative position fed behind an EOS is gone before the step notes what is held, so
    Stats.peak_cells / peak_tokens (and the K/V bytes a run reports from them) are the host path's."""
    eos = {an_eos(kind, tiny, at=3)}
    peaks = {}
    for pipeline in (False, True):
        e, _ = engine(kind, tiny, pipeline, eos=eos)
        reqs = requests(tiny, max_tokens=(9,), n=(1,))
        e.add(reqs)
        assert e.run() is True
        peaks[pipeline] = (e.stats.peak_cells, e.stats.peak_tokens)
    assert peaks[True] == peaks[False]
