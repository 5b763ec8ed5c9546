"""The two seams of a generating sample: its stopper, and the engine's token callback.

The oracle for stopping is the same run without the stopper: every sample
owns its generator, so a stopped sample's tokens are the unstopped run's,
cut where the stopper said, and every other sample is unchanged.
"""

from __future__ import annotations

import collections

import pytest

from tests.engines.conftest import cache_for, engine_for, outputs, requests_for
from tests.runner.flaky import POISON, FlakyModel

KINDS = ["seq", "cell"]


class StopAt:
    """A stopper ending its sample on the `k`-th token it keeps; remembers what it was fed."""

    def __init__(self, k: int):
        self.k, self.fed = k, []

    def __call__(self, token: int) -> bool:
        self.fed.append(token)
        return len(self.fed) == self.k


class Heard:
    """An on_token callback: per (request, sample), every (token, finish_reason at that moment)."""

    def __init__(self):
        self.events = collections.defaultdict(list)

    def __call__(self, request, sample, token):
        assert sample.request == request.index
        self.events[request.index, sample.index].append((token, sample.finish_reason))


def run(kind, tiny, reqs, **kw):
    setup = engine_for(kind, tiny, temperature=0.8, **kw)
    setup.engine.add(reqs)
    assert setup.engine.run() is True
    return setup


@pytest.mark.parametrize("kind", KINDS)
def test_a_stopper_ends_its_sample_where_it_says_and_nothing_more_is_generated(kind, tiny):
    free = requests_for(tiny, max_tokens=8)
    unstopped = run(kind, tiny, free)
    reqs = requests_for(tiny, max_tokens=8)
    stopper = reqs[1].samples[0].stopper = StopAt(3)
    heard = Heard()
    stopped = run(kind, tiny, reqs, on_token=heard)

    want = outputs(free)
    want[1][0] = (free[1].samples[0].generated[:3], "stop")
    assert outputs(reqs) == want
    assert stopper.fed == want[1][0][0]  # fed each kept token once, and none after the stop
    assert [t for t, _ in heard.events[1, 0]] == want[1][0][0]
    assert stopped.stats.generated_tokens == unstopped.stats.generated_tokens - 5
    assert sum(stopped.done) == sum(unstopped.done)  # the progress total settles the tokens never generated


@pytest.mark.parametrize("kind", KINDS)
def test_a_stop_on_the_last_allowed_token_is_a_stop_not_length(kind, tiny):
    reqs = requests_for(tiny, max_tokens=4)
    reqs[0].samples[1].stopper = StopAt(4)
    run(kind, tiny, reqs)
    assert [s.finish_reason for s in reqs[0].samples] == ["length", "stop"]
    assert len(reqs[0].samples[1].generated) == 4


@pytest.mark.parametrize("kind", KINDS)
def test_on_token_hears_every_token_of_every_sample_once_in_order_even_through_preemption(kind, tiny):
    heard = Heard()
    reqs = requests_for(tiny, max_tokens=10)
    # The cell cache is small enough that sequences are preempted and recomputed.
    cache = cache_for(kind, tiny[1], capacity=160) if kind == "cell" else None
    setup = run(kind, tiny, reqs, on_token=heard, cache=cache)
    if kind == "cell":
        assert setup.stats.preemptions > 0
    for r in reqs:
        for s in r.samples:
            events = heard.events[r.index, s.index]
            tokens = [t for t, _ in events]
            # Every kept token, then the EOS that ended it if one did.
            assert tokens in (s.generated, s.generated + [t for t in tokens[-1:] if t in tiny[2].eos_ids])
            assert [f for _, f in events] == [None] * (len(events) - 1) + [s.finish_reason]


@pytest.mark.parametrize("kind", KINDS)
def test_a_sample_that_fails_is_heard_once_without_a_token(kind, tiny):
    heard = Heard()
    model = FlakyModel(tiny[0], 1, poison=True)
    reqs = requests_for(tiny, questions=["Q: fine?\nA:", "Q: ~ poisoned\nA:"], max_tokens=4)
    assert POISON in reqs[1].prompt
    run(kind, tiny, reqs, on_token=heard, model=model)
    for s in reqs[1].samples:
        assert s.finish_reason == "error"
        assert heard.events[1, s.index] == [(None, "error")]
    assert all(len(heard.events[0, j]) == len(reqs[0].samples[j].generated) for j in range(2))
