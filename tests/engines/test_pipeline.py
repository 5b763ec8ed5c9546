"""Tokens drawn ahead on the device (engines.ahead) against the host path of the same engine.

The oracle is the engine with `pipeline=False`: every step waits for its
logits on the host and draws there, the path the generation tests check
against mlx-lm token for token. Drawing ahead must change nothing anyone can
see: the tokens and finish reasons, the order each sample's tokens are heard
in, what the cache holds afterwards (every cell free, or exactly the kept
prefixes), and a state saved mid-run, which a host-path engine continues to
the same end. The cases are the ones where a token in flight matters: EOS
and stop strings ending a sample whose next forward is already queued,
forks, sampled requests beside greedy ones, preemption, a failed forward,
and a prefix cache keeping what finished.
"""

from __future__ import annotations

import attrs
import pytest

from kvlayout.engines import CellEngine, EngineOptions, Sampling, SeqEngine, make_requests
from kvlayout.engines.prefixes import PrefixCache
from kvlayout.errors import PluginError
from tests.engines.conftest import QUESTIONS, SYSTEM, cache_for, outputs
from tests.engines.test_prefixes import assert_only_entries_hold
from tests.engines.test_stopping import Heard, StopAt
from tests.runner.flaky import Boom, FlakyModel

KINDS = ["seq", "cell"]


def engine(kind, tiny, pipeline, eos=(), capacity=1024, on_token=None, model=None, prefixes=False, chunk=16):
    base, args, _ = tiny
    cache = cache_for(kind, args, capacity)
    control = cache.as_control() if kind == "seq" else cache.as_batch_control()
    extra = {"on_token": on_token} if on_token is not None else {}
    options = EngineOptions(eos=frozenset(eos), sampling=Sampling(temperature=0.0, seed=3), chunk=chunk,
                            pipeline=pipeline, **extra)
    if kind == "seq":
        e = SeqEngine(model or base, cache, control, options)
    else:
        e = CellEngine(model or base, cache, control, options, PrefixCache(control) if prefixes else None)
    return e, cache


def requests(tiny, max_tokens=(9, 1, 2, 9), n=(1, 1, 1, 2), sampled=()):
    """SYSTEM + a question each; request i in `sampled` samples at temperature 0.9 (its own)."""
    _, _, tok = tiny
    questions = (QUESTIONS * 2)[: len(max_tokens)]
    reqs = make_requests([tok.encode(SYSTEM + q) for q in questions], list(max_tokens), list(n), 5)
    for i in sampled:
        reqs[i].sampling = Sampling(temperature=0.9, top_p=0.9, seed=5)
    return reqs


def run(kind, tiny, pipeline, reqs, **kw):
    heard = Heard()
    e, cache = engine(kind, tiny, pipeline, on_token=heard, **kw)
    e.add(reqs)
    assert e.run() is True
    return e, cache, heard


def an_eos(kind, tiny, at=3):
    """A token request 0 generates at index `at` when nothing stops it: as EOS it ends it there."""
    reqs = requests(tiny)
    run(kind, tiny, False, reqs)
    return reqs[0].samples[0].generated[at]


def assert_all_free(kind, cache):
    if kind == "cell":
        bc = cache.as_batch_control()
        assert bc.free_cells == bc.capacity


@pytest.mark.parametrize("kind", KINDS)
def test_drawing_ahead_gives_the_host_paths_tokens_heard_in_its_order_and_leaves_the_cache_as_it(kind, tiny):
    eos = {an_eos(kind, tiny)}
    want, got = requests(tiny, sampled=(3,)), requests(tiny, sampled=(3,))
    host_e, host_cache, host_heard = run(kind, tiny, False, want, eos=eos)
    e, cache, heard = run(kind, tiny, True, got, eos=eos)
    assert outputs(got) == outputs(want)
    assert want[0].samples[0].finish_reason == "stop" and len(want[0].samples[0].generated) == 3  # EOS mid-run
    assert dict(heard.events) == dict(host_heard.events)
    assert e.stats.generated_tokens == host_e.stats.generated_tokens
    assert e.stats.decode_tokens >= host_e.stats.decode_tokens  # a speculative step fed at most one more
    assert_all_free(kind, cache)


@pytest.mark.parametrize("kind", KINDS)
def test_a_token_is_in_flight_between_steps_for_a_greedy_sample_and_never_for_a_sampled_one(kind, tiny):
    def in_flight(e):
        if kind == "seq":
            return e.generating is not None and e.generating.drawn is not None
        return any(s.drawn is not None for s in e.scheduler.running)

    for sampled, expect in (((), True), ((0,), False)):
        e, _ = engine(kind, tiny, True)
        e.add(requests(tiny, max_tokens=(6,), n=(1,), sampled=sampled))
        seen = False
        while e.has_work:
            e.step()
            seen |= in_flight(e)
        assert seen is expect
    off, _ = engine(kind, tiny, False)
    off.add(requests(tiny, max_tokens=(6,), n=(1,)))
    while off.has_work:
        off.step()
        assert not in_flight(off)


@pytest.mark.parametrize("kind", KINDS)
def test_a_stopper_ending_a_sample_whose_next_forward_is_queued_keeps_nothing_after_it(kind, tiny):
    want, got = requests(tiny), requests(tiny)
    for reqs in (want, got):
        reqs[0].samples[0].stopper = StopAt(2)
        reqs[3].samples[1].stopper = StopAt(4)
    host_e, _, host_heard = run(kind, tiny, False, want)
    _, cache, heard = run(kind, tiny, True, got)
    assert outputs(got) == outputs(want)
    assert [len(s.generated) for s in (got[0].samples[0], got[3].samples[1])] == [2, 4]
    assert dict(heard.events) == dict(host_heard.events)
    assert_all_free(kind, cache)


@pytest.mark.parametrize("part", [1, 3, 6])
@pytest.mark.parametrize("kind", KINDS)
def test_a_state_saved_mid_run_with_a_token_in_flight_is_continued_by_the_host_path_to_the_same_end(
    kind, tiny, tmp_path, part
):
    import kvlayout

    want = requests(tiny)
    run(kind, tiny, False, want)
    got = requests(tiny)
    e, cache = engine(kind, tiny, True)
    e.add(got)
    for _ in range(part):
        e.step()
    state = e.state()  # reads what is in flight first
    path = cache.save(tmp_path / "cache.kvl")
    restored = kvlayout.load(path)
    control = restored.as_control() if kind == "seq" else restored.as_batch_control()
    cls = SeqEngine if kind == "seq" else CellEngine
    model, _, _ = tiny
    fresh = cls(model, restored, control, EngineOptions(sampling=Sampling(temperature=0.0, seed=3), chunk=16,
                                                        pipeline=False))
    fresh.restore(state, got)
    assert fresh.run() is True
    assert outputs(got) == outputs(want)


def test_preemption_with_tokens_in_flight_gives_the_host_paths_tokens(tiny):
    # 120 cells for four prompts of 62-75 tokens, one forking: the cell engine must preempt.
    want, got = requests(tiny, max_tokens=(12, 10, 12, 8)), requests(tiny, max_tokens=(12, 10, 12, 8))
    host_e, _, _ = run("cell", tiny, False, want, capacity=120)
    e, cache, _ = run("cell", tiny, True, got, capacity=120)
    assert host_e.stats.preemptions > 0 and e.stats.preemptions > 0
    assert outputs(got) == outputs(want)
    assert_all_free("cell", cache)


@pytest.mark.parametrize("exc, after", [(Boom, False), (Boom, True), (PluginError, False)])
@pytest.mark.parametrize("kind", KINDS)
def test_a_forward_that_fails_while_feeding_a_token_drawn_ahead_ends_as_on_the_host_path(kind, tiny, exc, after):
    """Retried (a transient failure) or failing its samples at once (a plugin's fault, not
    retried): either way the token it fed was drawn by a forward that succeeded, and is kept."""
    model, _, _ = tiny
    results = []
    for pipeline in (False, True):
        reqs = requests(tiny)
        # Forward 6 is a decode step for both engines, feeding a token drawn ahead; k=None fails after every layer.
        flaky = FlakyModel(model, None if after else 1, fail_calls=(6,), exc=exc)
        e, cache, _ = run(kind, tiny, pipeline, reqs, model=flaky)
        assert flaky.layer.raised == 1 and e.stats.failed_forwards == 1
        assert_all_free(kind, cache)
        results.append(outputs(reqs))
    assert results[1] == results[0]
    assert any(reason == "error" for r in results[0] for _, reason in r) is (exc is PluginError)


def test_a_prefix_cache_keeps_exactly_the_tokens_of_samples_that_ended_with_a_forward_queued(tiny):
    eos = {an_eos("cell", tiny)}
    _, _, tok = tiny
    prompts = [SYSTEM + q for q in QUESTIONS]
    results = {}
    for pipeline in (False, True):
        e, cache = engine("cell", tiny, pipeline, eos=eos, prefixes=True)
        done = []
        for i, p in enumerate(prompts * 2):  # the second round reuses what the first kept
            r = attrs.evolve(make_requests([tok.encode(p)], [6], [1], 5)[0], index=i)
            e.add([r])
            assert e.run() is True
            done.append(r)
        assert_only_entries_hold(e, cache.as_batch_control(), e.prefixes)
        results[pipeline] = (outputs(done), [r.cached_tokens for r in done])
    assert results[True] == results[False]
    assert any(results[True][1][len(prompts):])  # the second round did reuse


def test_a_steady_decode_steps_feed_is_what_the_sequence_by_sequence_reading_gives(tiny, monkeypatch):
    # Feed.fed_ahead_only reads a step where every sequence feeds only its token drawn ahead in one pass;
    # the oracle is Feed.each, the general reading, on every plan of a mixed run (greedy beside sampled,
    # forks, a stopper, prompts still in): where the shortcut answers it must agree, and it must answer.
    from kvlayout.engines.cell import Feed

    answered = []
    general = Feed.of.__func__

    def checked(cls, plan):
        steady = cls.fed_ahead_only(plan)
        if steady is not None:
            assert steady == cls.each(plan)
            answered.append(len(plan))
        return general(cls, plan)

    monkeypatch.setattr(Feed, "of", classmethod(checked))
    reqs = requests(tiny, max_tokens=(30, 24, 2, 3), n=(1, 1, 1, 2), sampled=(3,))
    run("cell", tiny, True, reqs)  # the sampled request ends early: the long ones then decode ahead together
    assert answered and max(answered) >= 2  # steady steps of more than one sequence were read off
