"""Speculative decoding (engines.drafts) against the same engine with speculation off.

The oracle is the engine with `speculate="off"`, whose tokens the generation
tests check against mlx-lm. Speculation must change nothing anyone can see
but the step count: the tokens and finish reasons at any temperature (the
seed contract: a sample draws one number per kept token either way), the
order each sample's tokens are heard in, what the cache holds afterwards,
and a state saved mid-run. The model is the tiny preset nudged to repeat
itself (`Repeating`): drafts are found and most are kept, and every sixth
position it goes its own way, so some are rejected and rolled back. Pacing
is made eager here (every draft found is verified), so the machinery runs
on every step; whether drafting pays is tested apart (tests/engines/test_drafts.py).
"""

from __future__ import annotations

import attrs
import mlx.core as mx
import numpy as np
import pytest

import kvlayout
from kvlayout.engines import CellEngine, EngineOptions, Sampling, SeqEngine, drafts, make_requests
from kvlayout.engines.prefixes import PrefixCache
from kvlayout.errors import PluginError
from tests.engines.conftest import QUESTIONS, SYSTEM, cache_for, outputs
from tests.engines.test_pipeline import requests as pipeline_requests
from tests.engines.test_prefixes import assert_only_entries_hold
from tests.engines.test_stopping import Heard, StopAt
from tests.runner.flaky import Boom, FlakyModel

KINDS = ["seq", "cell"]


class Repeating:
    """The tiny model with each row's logits pushed towards a fixed successor of the row's input token
    (a cycle of 7 ids), except at every sixth position: its text repeats, with breaks a draft misses."""

    def __init__(self, model, vocab: int):
        self.inner, self.vocab = model, vocab

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __call__(self, tokens, positions, cache, rows=None):
        logits = self.inner(tokens, positions, cache, rows=rows)  # [R, V]
        rows = list(rows) if rows is not None else [len(positions) - 1]
        fed = tokens if isinstance(tokens, mx.array) else mx.array(tokens)
        successor = fed[mx.array(rows)].astype(mx.int32) % 7 + 10  # [R]
        on = mx.array(((np.asarray(list(positions))[rows] + 1) % 6 != 0).astype(np.float32))  # [R]
        pushed = (mx.arange(self.vocab)[None, :] == successor[:, None]).astype(logits.dtype)  # [R, V]
        return logits + 30.0 * on[:, None] * pushed


class Eager(drafts.Pacing):
    """Pacing that verifies every draft it finds (as if a draft token cost nothing): the machinery
    under test on every step."""

    MARGIN = 0.0

    def extra_cost(self, fed: int, more: int) -> float:
        return 0.0


@pytest.fixture(scope="module")
def repeating(tiny):
    model, args, tok = tiny
    return Repeating(model, args.vocab_size), args, tok


def engine(kind, loaded, speculate, eos=(), capacity=1024, on_token=None, model=None, prefixes=False, pipeline=True,
           agree=None):
    base, args, _ = loaded
    cache = cache_for(kind, args, capacity)
    control = cache.as_control() if kind == "seq" else cache.as_batch_control()
    extra = {"on_token": on_token} if on_token is not None else {}
    if agree is not None:
        extra["agree"] = agree
    options = EngineOptions(eos=frozenset(eos), sampling=Sampling(temperature=0.0, seed=3), chunk=16,
                            pipeline=pipeline, speculate="ngram" if speculate else "off", **extra)
    if kind == "seq":
        e = SeqEngine(model or base, cache, control, options)
        if speculate:
            e.pacing = Eager(options.speculate_tokens, timed=False)
    else:
        e = CellEngine(model or base, cache, control, options, PrefixCache(control) if prefixes else None)
        if speculate:
            e.drafts.pacing = Eager(options.speculate_tokens, timed=False)
    return e, cache


def requests(loaded, max_tokens=(30, 1, 2, 24), n=(1, 1, 1, 2), sampled=()):
    """test_pipeline's requests, longer: drafts have room to run."""
    return pipeline_requests(loaded, max_tokens, n, sampled)


def run(kind, loaded, speculate, reqs, **kw):
    heard = Heard()
    e, cache = engine(kind, loaded, speculate, on_token=heard, **kw)
    e.add(reqs)
    assert e.run() is True
    return e, cache, heard


def assert_all_free(kind, cache):
    if kind == "cell":
        bc = cache.as_batch_control()
        assert bc.free_cells == bc.capacity


def assert_drafts_were_kept_and_rejected(stats):
    assert 0 < stats.accepted_tokens < stats.drafted_tokens


@pytest.mark.parametrize("kind", KINDS)
def test_speculation_gives_the_same_tokens_heard_in_the_same_order_in_fewer_steps(kind, repeating):
    want, got = requests(repeating, sampled=(3,)), requests(repeating, sampled=(3,))
    off, _, off_heard = run(kind, repeating, False, want)
    on, cache, heard = run(kind, repeating, True, got)
    assert outputs(got) == outputs(want)
    assert dict(heard.events) == dict(off_heard.events)
    assert_drafts_were_kept_and_rejected(on.stats)
    assert on.stats.failed_forwards == 0
    assert on.stats.steps < off.stats.steps
    assert on.stats.generated_tokens == off.stats.generated_tokens
    assert off.stats.drafted_tokens == off.stats.accepted_tokens == 0
    assert_all_free(kind, cache)


@pytest.mark.parametrize("kind", KINDS)
def test_every_sample_keeps_the_tokens_it_draws_without_speculation_at_any_temperature(kind, repeating):
    """The seed contract: sampled requests (two samples forking from one prompt among them) generate
    what they do with speculation off, token for token."""
    want = requests(repeating, max_tokens=(20, 24), n=(2, 1), sampled=(0, 1))
    got = requests(repeating, max_tokens=(20, 24), n=(2, 1), sampled=(0, 1))
    run(kind, repeating, False, want)
    on, _, _ = run(kind, repeating, True, got)
    assert outputs(got) == outputs(want)
    assert_drafts_were_kept_and_rejected(on.stats)


@pytest.mark.parametrize("kind", KINDS)
def test_an_eos_or_a_stopper_inside_a_kept_draft_ends_the_sample_there_and_keeps_nothing_after_it(kind, repeating):
    # The successor of the successor of ... : 12 follows 15 in the repeating cycle; as EOS it ends a sample
    # inside a run of kept drafts.
    want, got = requests(repeating), requests(repeating)
    for reqs in (want, got):
        reqs[3].samples[1].stopper = StopAt(9)
    off, _, off_heard = run(kind, repeating, False, want, eos={12})
    on, cache, heard = run(kind, repeating, True, got, eos={12})
    assert outputs(got) == outputs(want)
    assert any(s.finish_reason == "stop" for r in got for s in r.samples)
    assert dict(heard.events) == dict(off_heard.events)
    assert_all_free(kind, cache)


@pytest.mark.parametrize("part", [2, 5])
@pytest.mark.parametrize("kind", KINDS)
def test_a_state_saved_mid_run_is_continued_to_the_same_end_with_speculation_off_or_on(kind, repeating, tmp_path,
                                                                                          part):
    want = requests(repeating)
    run(kind, repeating, False, want)
    for fresh_speculates in (False, True):
        got = requests(repeating)
        e, cache = engine(kind, repeating, True)
        e.add(got)
        for _ in range(part):
            e.step()
        state = e.state()
        restored = kvlayout.load(cache.save(tmp_path / f"cache{fresh_speculates}.kvl"))
        fresh, _ = engine(kind, repeating, fresh_speculates)
        control = restored.as_control() if kind == "seq" else restored.as_batch_control()
        fresh = type(fresh)(repeating[0], restored, control, fresh.options)
        fresh.restore(state, got)
        assert fresh.run() is True
        assert outputs(got) == outputs(want)


def test_drafts_give_way_to_the_running_sequences_and_preemption_keeps_the_tokens(repeating):
    # 120 cells for four prompts of 62-75 tokens, one forking: the cell engine must preempt.
    want, got = requests(repeating, max_tokens=(12, 10, 12, 8)), requests(repeating, max_tokens=(12, 10, 12, 8))
    off, _, _ = run("cell", repeating, False, want, capacity=120)
    on, cache, _ = run("cell", repeating, True, got, capacity=120)
    assert off.stats.preemptions > 0 and on.stats.preemptions > 0
    assert outputs(got) == outputs(want)
    assert on.stats.accepted_tokens > 0
    assert_all_free("cell", cache)


@pytest.mark.parametrize("exc, after", [(Boom, False), (Boom, True), (PluginError, False)])
@pytest.mark.parametrize("kind", KINDS)
def test_a_forward_that_fails_while_verifying_drafts_ends_as_without_speculation(kind, repeating, exc, after):
    """Retried (a transient failure: the tokens of a run without one), or failing the samples it
    carried at once (a plugin's fault: each has a head of those tokens, "error")."""
    model, _, _ = repeating
    want = requests(repeating)
    run(kind, repeating, False, want)
    got = requests(repeating)
    flaky = FlakyModel(model, None if after else 1, fail_calls=(20,), exc=exc)  # forward 20 verifies drafts
    e, cache, _ = run(kind, repeating, True, got, model=flaky)
    assert flaky.layer.raised == 1 and e.stats.failed_forwards == 1
    assert e.stats.drafted_tokens > 0
    assert_all_free(kind, cache)
    if exc is Boom:
        assert outputs(got) == outputs(want)
        return
    failed = [(g, w) for r, q in zip(got, want) for g, w in zip(r.samples, q.samples) if g.finish_reason == "error"]
    assert failed
    assert all(g.generated == w.generated[: len(g.generated)] for g, w in failed)
    assert [o for o in outputs(got) if all(x[1] != "error" for x in o)] == [
        o for o, mine in zip(outputs(want), outputs(got)) if all(x[1] != "error" for x in mine)]


def test_a_prefix_cache_keeps_exactly_the_tokens_of_samples_that_ended_inside_kept_drafts(repeating):
    _, _, tok = repeating
    prompts = [SYSTEM + q for q in QUESTIONS]
    results = {}
    for speculate in (False, True):
        e, cache = engine("cell", repeating, speculate, eos={12}, prefixes=True)
        done = []
        for i, p in enumerate(prompts * 2):  # the second round reuses what the first kept
            r = attrs.evolve(make_requests([tok.encode(p)], [14], [1], 5)[0], index=i)
            e.add([r])
            assert e.run() is True
            done.append(r)
        assert_only_entries_hold(e, cache.as_batch_control(), e.prefixes)
        results[speculate] = (outputs(done), [r.cached_tokens for r in done])
    assert results[True] == results[False]
    assert any(results[True][1][len(prompts):])  # the second round did reuse


@pytest.mark.parametrize("kind", KINDS)
def test_cancelling_a_request_between_speculative_steps_frees_its_cells_and_leaves_the_others(kind, repeating):
    want, got = requests(repeating), requests(repeating)
    run(kind, repeating, False, want)
    e, cache = engine(kind, repeating, True)
    e.add(got)
    for _ in range(6):
        e.step()
    e.cancel(got[3])
    assert e.run() is True
    assert [s.finish_reason for s in got[3].samples] == ["cancelled"] * 2 or kind == "seq"
    assert outputs(got)[:3] == outputs(want)[:3]
    assert_all_free(kind, cache)


@pytest.mark.parametrize("kind", KINDS)
def test_ranks_agreeing_on_tokens_take_the_agreed_ones_and_draft_untimed(kind, repeating):
    """Tensor-parallel, an Agree collective makes rank 0's tokens everyone's: the verified drafts go
    through it too, padded to one length per step (here an Agree that keeps the tokens: same output)."""
    calls = []

    def agree(tokens):
        calls.append(list(tokens))
        return list(tokens)

    want, got = requests(repeating), requests(repeating)
    run(kind, repeating, False, want)
    e, _, _ = run(kind, repeating, True, got, agree=agree)
    assert outputs(got) == outputs(want)
    assert any(-1 in c for c in calls)  # a rejected draft's padding crossed the collective
    pacing = e.pacing if kind == "seq" else e.drafts.pacing
    assert not pacing.cost.timed


@pytest.mark.parametrize("kind", KINDS)
def test_the_pacing_of_a_run_keeps_its_tokens_whatever_it_chooses(kind, repeating):
    """With the engine's own (timed) Pacing, whatever it drafts, the tokens are speculation off's."""
    want, got = requests(repeating), requests(repeating)
    run(kind, repeating, False, want)
    base, args, _ = repeating
    cache = cache_for(kind, args)
    control = cache.as_control() if kind == "seq" else cache.as_batch_control()
    options = EngineOptions(sampling=Sampling(temperature=0.0, seed=3), chunk=16, speculate="ngram")
    e = (SeqEngine if kind == "seq" else CellEngine)(base, cache, control, options)
    e.add(got)
    assert e.run() is True
    assert outputs(got) == outputs(want)
    assert e.stats.accepted_tokens <= e.stats.drafted_tokens


@pytest.mark.parametrize("model_kind", ["repeating", "tiny"])
def test_an_admission_that_does_not_fit_after_drafts_gave_way_leaves_a_step_without_them(repeating, tiny, model_kind):
    """80 cells, prompts admitted while others decode with drafts: an admission's trial drops the drafts
    and still does not fit; the step then runs without them (no forward fails)."""
    loaded = repeating if model_kind == "repeating" else tiny
    _, _, tok = loaded
    prompts = [("The cells of a cache, shared by forks", 14, 2), ("a second prompt", 10, 1),
               ("and a third, longer than the others by a few words", 12, 2)]
    results = []
    for speculate in (False, True):
        reqs = make_requests([tok.encode(p) for p, _, _ in prompts], [m for _, m, _ in prompts],
                             [n for _, _, n in prompts], 0)
        e, cache = engine("cell", loaded, speculate, capacity=80)
        e.options.chunk = e.scheduler.chunk = 64
        e.add(reqs)
        assert e.run() is True
        assert e.stats.failed_forwards == 0 and e.stats.preemptions > 0
        assert_all_free("cell", cache)
        results.append(outputs(reqs))
    assert results[1] == results[0]
