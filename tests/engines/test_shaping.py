"""Logits shaping in both engines (engines.shaping): logprobs, logit_bias, presence and frequency
penalties and constraints, on their own, batched with plain samples and across forks.

The oracle is the tiny model run over the whole prefix (prompt and what the sample generated so
far) without a cache (tests.runner.conftest.NoCache), shaped here in numpy by the documented rules:
a bias adds its amount, a penalty subtracts `presence` once for every id the sample generated and
`frequency` once per time it did, a constraint leaves only its ids. For mixed batches and forks the
oracle is each sample generated alone in a fresh engine.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import numpy as np
import pytest

from kvlayout.engines import Request, Sample, Sampling
from kvlayout.engines import ahead as ahead_module
from kvlayout.engines.sampling import sample_rng
from tests.engines.conftest import QUESTIONS, SYSTEM, engine_for
from tests.runner.conftest import NoCache

KINDS = ["seq", "cell"]
SEED = 3
TOLERANCE = 1e-4


# -- the oracle


def cache_free_logits(model, tokens: list[int]) -> np.ndarray:
    """The model's float64 logits `[V]` after `tokens`, recomputed over the whole sequence."""
    logits = model(tokens, range(len(tokens)), NoCache(model.args.windows), rows=[len(tokens) - 1])
    return np.array(logits[0], dtype=np.float64)


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max()
    return shifted - np.log(np.exp(shifted).sum())


def shaped_greedy(model, prompt: list[int], max_tokens: int, eos: frozenset[int], bias: dict[int, float] | None = None,
                  presence: float = 0.0, frequency: float = 0.0,
                  allowed: Callable[[list[int]], Iterable[int]] | None = None) -> tuple[list[int], str]:
    """Greedy generation from cache-free logits shaped in numpy: plus `bias`, minus the penalties over
    what was generated so far, only the ids `allowed(generated)` gives (all when None)."""
    out: list[int] = []
    while True:
        logits = cache_free_logits(model, prompt + out)
        for token, amount in (bias or {}).items():
            logits[token] += amount
        counts = np.bincount(np.asarray(out, dtype=np.int64), minlength=logits.size)
        logits -= frequency * counts + presence * (counts > 0)
        if allowed is not None:
            keep = np.full(logits.size, -np.inf)
            ids = list(allowed(out))
            keep[ids] = logits[ids]
            logits = keep
        token = int(np.argmax(logits))
        if token in eos:
            return out, "stop"
        out.append(token)
        if len(out) == max_tokens:
            return out, "length"


# -- building and running requests


def prompt_of(tiny, question: str) -> list[int]:
    return tiny[2].encode(SYSTEM + question)


def request(tiny, index: int, question: str, max_tokens: int, sampling: Sampling | None = None, n: int = 1,
            sample_ids: Iterable[int] | None = None) -> Request:
    """A request whose samples draw from the generators make_requests would give them (`sample_ids`:
    which of them it holds, to run one sample of an `n` alone)."""
    ids = list(range(n)) if sample_ids is None else list(sample_ids)
    r = Request(index, prompt_of(tiny, question), max_tokens, len(ids), sampling=sampling)
    r.samples = [Sample(index, j, sample_rng(SEED, index, j)) for j in ids]
    return r


def run(kind: str, tiny, requests: list[Request]) -> list[Request]:
    """Run `requests` together, to the end, in a fresh engine of `kind` (pipelined: the default)."""
    setup = engine_for(kind, tiny)
    setup.engine.add(requests)
    setup.engine.run()
    return requests


def eos_of(tiny) -> frozenset[int]:
    return frozenset(tiny[2].eos_ids)


@pytest.fixture
def draws_ahead(monkeypatch) -> list[int]:
    """Counts the engines' calls of engines.ahead.draw (a step drawing greedy tokens on the device)."""
    calls: list[int] = []
    real = ahead_module.draw

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(ahead_module, "draw", counting)
    return calls


class Spy:
    """A fake constraint allowing `allowed(accepted so far)` (kvlayout.engines.shaping.Constraint);
    it logs every call, in order."""

    def __init__(self, allowed: Callable[[list[int]], Iterable[int]]):
        self.allowed = allowed
        self.accepted: list[int] = []
        self.calls: list[str | int] = []  # "fill", or an accepted token

    def fill(self, words: np.ndarray) -> None:
        self.calls.append("fill")
        bits = words.view(np.uint32)  # bit 31 set is a negative int32
        for token in self.allowed(self.accepted):
            bits[token // 32] |= np.uint32(1 << (token % 32))

    def accept(self, token: int) -> None:
        self.calls.append(token)
        self.accepted.append(token)


# -- logprobs


@pytest.mark.parametrize("kind", KINDS)
def test_logprobs_are_the_raw_log_softmax_with_the_most_likely_first_and_change_no_token(kind, tiny, draws_ahead):
    model = tiny[0]
    plain = run(kind, tiny, [request(tiny, 0, QUESTIONS[0], 8)])[0].samples[0]
    assert draws_ahead, "the plain greedy run was drawn ahead on the device"
    draws_ahead.clear()
    logged = run(kind, tiny, [request(tiny, 0, QUESTIONS[0], 8, Sampling(logprobs=5))])
    assert not draws_ahead, "a sample reporting logprobs is drawn on the host path"
    sample = logged[0].samples[0]
    assert sample.generated == plain.generated and len(sample.generated) == 8
    assert [lp.token for lp in sample.logprobs] == sample.generated
    prompt = logged[0].prompt
    for step, (token, lp) in enumerate(zip(sample.generated, sample.logprobs)):
        expected = log_softmax(cache_free_logits(model, prompt + sample.generated[:step]))
        assert lp.logprob == pytest.approx(expected[token], abs=TOLERANCE)
        most_likely = np.argsort(-expected, kind="stable")[:5].tolist()
        assert [t for t, _ in lp.top] == most_likely
        assert [v for _, v in lp.top] == pytest.approx(expected[most_likely].tolist(), abs=TOLERANCE)
        assert lp.top[0] == (token, lp.logprob)  # greedy: the kept token is the most likely


@pytest.mark.parametrize("kind", KINDS)
def test_logprobs_zero_reports_each_tokens_logprob_and_no_alternatives(kind, tiny):
    r = run(kind, tiny, [request(tiny, 0, QUESTIONS[1], 5, Sampling(logprobs=0))])[0]
    sample = r.samples[0]
    assert len(sample.logprobs) == len(sample.generated) == 5
    for step, (token, lp) in enumerate(zip(sample.generated, sample.logprobs)):
        assert lp.top == ()
        expected = log_softmax(cache_free_logits(tiny[0], r.prompt + sample.generated[:step]))
        assert (lp.token, lp.logprob) == (token, pytest.approx(expected[token], abs=TOLERANCE))


@pytest.mark.parametrize("kind", KINDS)
def test_logprobs_of_a_biased_sample_are_the_models_before_the_bias(kind, tiny):
    forced = 65  # "A", not EOS
    r = run(kind, tiny, [request(tiny, 0, QUESTIONS[2], 4, Sampling(logit_bias=((forced, 100.0),), logprobs=2))])[0]
    sample = r.samples[0]
    assert sample.generated == [forced] * 4
    for step, lp in enumerate(sample.logprobs):
        expected = log_softmax(cache_free_logits(tiny[0], r.prompt + sample.generated[:step]))
        assert expected[forced] < -1.0  # so a logprob taken after the bias (near 0) could not pass
        assert lp.logprob == pytest.approx(expected[forced], abs=TOLERANCE)
        assert [t for t, _ in lp.top] == np.argsort(-expected, kind="stable")[:2].tolist()


# -- logit_bias and penalties


@pytest.mark.parametrize("kind", KINDS)
def test_a_large_bias_on_an_id_makes_greedy_generate_it_every_step(kind, tiny):
    forced = 200
    assert forced not in eos_of(tiny)
    r = run(kind, tiny, [request(tiny, 0, QUESTIONS[0], 6, Sampling(logit_bias=((forced, 100.0),)))])[0]
    assert (r.samples[0].generated, r.samples[0].finish_reason) == ([forced] * 6, "length")


@pytest.mark.parametrize("kind", KINDS)
def test_a_large_negative_bias_on_the_greedy_token_gives_the_second_most_likely(kind, tiny):
    prompt = prompt_of(tiny, QUESTIONS[1])
    unbiased = cache_free_logits(tiny[0], prompt)
    first, second = np.argsort(-unbiased, kind="stable")[:2].tolist()
    bias = {first: -100.0}
    r = run(kind, tiny, [request(tiny, 0, QUESTIONS[1], 6, Sampling(logit_bias=tuple(bias.items())))])[0]
    assert r.samples[0].generated[0] == second
    # and every later step is the argmax of the biased logits
    expected = shaped_greedy(tiny[0], prompt, 6, eos_of(tiny), bias=bias)
    assert (r.samples[0].generated, r.samples[0].finish_reason) == expected


# Equal biases on a few ids keep the greedy choice among them, so the penalties decide it.
CLOSE_RACE = {65: 10.0, 66: 10.0, 67: 10.0}
PENALTIES = [(0.0, 2.0), (3.0, 0.0), (0.5, 1.5)]  # (presence, frequency)


@pytest.mark.parametrize("presence,frequency", PENALTIES)
@pytest.mark.parametrize("kind", KINDS)
def test_penalties_subtract_presence_once_and_frequency_per_time_over_what_the_sample_generated(
        kind, tiny, presence, frequency):
    prompt, eos = prompt_of(tiny, QUESTIONS[0]), eos_of(tiny)
    expected = shaped_greedy(tiny[0], prompt, 8, eos, CLOSE_RACE, presence, frequency)
    unpenalized = shaped_greedy(tiny[0], prompt, 8, eos, CLOSE_RACE)
    assert expected != unpenalized  # the penalty decides some step: ignoring it could not pass
    sampling = Sampling(logit_bias=tuple(CLOSE_RACE.items()), presence_penalty=presence, frequency_penalty=frequency)
    r = run(kind, tiny, [request(tiny, 0, QUESTIONS[0], 8, sampling)])[0]
    assert (r.samples[0].generated, r.samples[0].finish_reason) == expected


# -- constraints


def interleaved(tokens: list[int], last_fill: bool) -> list[str | int]:
    """A constraint's calls when each token was drawn from a fill made after the previous one was
    accepted (`last_fill`: one more fill, for the EOS that ended the sample and was not kept)."""
    calls: list[str | int] = []
    for token in tokens:
        calls += ["fill", token]
    return calls + ["fill"] * last_fill


def assert_filled_before_each_token(kind: str, calls: list[str | int], tokens: list[int], last_fill: bool) -> None:
    """Each kept token was accepted once, in order, and drawn from the one fill made after the previous
    one was accepted (no fill for a prompt chunk that draws nothing)."""
    assert calls == interleaved(tokens, last_fill)


# Bit 31 of a word (ids 31, 95) is the sign bit of an int32 mask word.
ALLOWED_SET = (31, 95, 100, 200)


@pytest.mark.parametrize("kind", KINDS)
def test_a_constraint_allowing_a_set_restricts_every_token_and_hears_each_kept_one_in_order(kind, tiny):
    prompt, eos = prompt_of(tiny, QUESTIONS[0]), eos_of(tiny)

    def allowed(_generated):
        return ALLOWED_SET

    expected = shaped_greedy(tiny[0], prompt, 6, eos, allowed=allowed)
    assert not set(shaped_greedy(tiny[0], prompt, 6, eos)[0]) <= set(ALLOWED_SET)  # it does restrict
    r = request(tiny, 0, QUESTIONS[0], 6)
    spy = r.samples[0].constraint = Spy(allowed)
    run(kind, tiny, [r])
    assert (r.samples[0].generated, r.samples[0].finish_reason) == expected
    assert_filled_before_each_token(kind, spy.calls, expected[0], last_fill=False)


@pytest.mark.parametrize("kind", KINDS)
def test_a_constraint_spelling_a_fixed_sequence_then_eos_generates_exactly_it_and_stops(kind, tiny):
    spelled = [104, 105, 31, 256, 33]  # "hi", a sign-bit id, a special id, "!"
    (eos_id,) = eos_of(tiny)

    def allowed(generated):
        return [spelled[len(generated)]] if len(generated) < len(spelled) else [eos_id]

    r = request(tiny, 0, QUESTIONS[1], 8)
    spy = r.samples[0].constraint = Spy(allowed)
    run(kind, tiny, [r])
    assert (r.samples[0].generated, r.samples[0].finish_reason) == (spelled, "stop")
    assert_filled_before_each_token(kind, spy.calls, spelled, last_fill=True)


# -- shaping one sequence changes no other


def mixed_batch(tiny) -> list[Request]:
    """A plain greedy request (drawn ahead), a sampled one, one reporting logprobs, a constrained
    one and a biased, penalised one, each with the same generators wherever it runs."""
    plain = request(tiny, 0, QUESTIONS[0], 8)
    sampled = request(tiny, 1, QUESTIONS[1], 8, Sampling(temperature=0.8, top_p=0.9))
    logged = request(tiny, 2, QUESTIONS[2], 8, Sampling(logprobs=3))
    constrained = request(tiny, 3, "Q: what is a KV cell?\nA:", 6)
    constrained.samples[0].constraint = Spy(lambda _generated: ALLOWED_SET)
    penalised = request(tiny, 4, QUESTIONS[0], 8, Sampling(logit_bias=tuple(CLOSE_RACE.items()),
                                                            frequency_penalty=2.0))
    return [plain, sampled, logged, constrained, penalised]


def assert_same_samples(got: Sample, alone: Sample) -> None:
    assert (got.generated, got.finish_reason) == (alone.generated, alone.finish_reason)
    assert [(lp.token, [t for t, _ in lp.top]) for lp in got.logprobs] == [
        (lp.token, [t for t, _ in lp.top]) for lp in alone.logprobs]
    for lp, lone in zip(got.logprobs, alone.logprobs):
        assert lp.logprob == pytest.approx(lone.logprob, abs=TOLERANCE)
        assert [v for _, v in lp.top] == pytest.approx([v for _, v in lone.top], abs=TOLERANCE)
    if got.constraint is not None:
        assert got.constraint.accepted == alone.constraint.accepted == got.generated


@pytest.mark.parametrize("kind", KINDS)
def test_in_a_mixed_batch_each_request_generates_what_it_generates_alone(kind, tiny, draws_ahead):
    setup = engine_for(kind, tiny, chunk=512)  # every prompt in the first step: all five decode together
    together = mixed_batch(tiny)
    setup.engine.add(together)
    setup.engine.run()
    assert setup.stats.max_batch == (5 if kind == "cell" else 1)
    assert draws_ahead, "the plain greedy request was drawn ahead on the device"
    for i, got in enumerate(together):
        (alone,) = run(kind, tiny, [mixed_batch(tiny)[i]])
        assert_same_samples(got.samples[0], alone.samples[0])
    greedy_of_sampled = shaped_greedy(tiny[0], together[1].prompt, 8, eos_of(tiny))[0]
    assert together[1].samples[0].generated != greedy_of_sampled  # it was sampled, not greedy
    assert set(together[3].samples[0].generated) <= set(ALLOWED_SET)


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_forks_with_penalties_each_count_only_their_own_tokens(kind, tiny):
    prompt, eos = prompt_of(tiny, QUESTIONS[0]), eos_of(tiny)
    presence, frequency = 0.5, 1.5
    expected = shaped_greedy(tiny[0], prompt, 8, eos, CLOSE_RACE, presence, frequency)
    # Counting both samples' tokens (they generate the same) would double every count: a different run.
    assert expected != shaped_greedy(tiny[0], prompt, 8, eos, CLOSE_RACE, presence, 2 * frequency)
    sampling = Sampling(logit_bias=tuple(CLOSE_RACE.items()), presence_penalty=presence, frequency_penalty=frequency)
    r = run(kind, tiny, [request(tiny, 0, QUESTIONS[0], 8, sampling, n=2)])[0]
    assert [(s.generated, s.finish_reason) for s in r.samples] == [expected, expected]


@pytest.mark.parametrize("kind", KINDS)
def test_sampled_forks_with_penalties_each_generate_what_they_generate_alone(kind, tiny):
    sampling = Sampling(temperature=0.8, logit_bias=tuple(CLOSE_RACE.items()), frequency_penalty=2.0)
    forked = run(kind, tiny, [request(tiny, 0, QUESTIONS[1], 8, sampling, n=2)])[0]
    assert forked.samples[0].generated != forked.samples[1].generated  # the samples parted
    for j, got in enumerate(forked.samples):
        (alone,) = run(kind, tiny, [request(tiny, 0, QUESTIONS[1], 8, sampling, n=2, sample_ids=[j])])
        assert_same_samples(got, alone.samples[0])


# -- scoring the prompt (a legacy completion's echo with logprobs)


@pytest.mark.parametrize("kind", KINDS)
def test_a_scored_prompt_holds_each_tokens_logprob_given_what_precedes_it_across_chunks(kind, tiny):
    model = tiny[0]
    r = request(tiny, 0, QUESTIONS[1], 3)  # longer than a chunk of 16: scored over several steps
    plain = request(tiny, 1, QUESTIONS[1], 3)
    r.score_prompt = 3
    run(kind, tiny, [r, plain])
    prompt = r.prompt
    assert len(prompt) > 16 and len(r.prompt_logprobs) == len(prompt) and r.prompt_logprobs[0] is None
    for p in range(1, len(prompt)):
        expected = log_softmax(cache_free_logits(model, prompt[:p]))
        got = r.prompt_logprobs[p]
        assert got.token == prompt[p] and abs(got.logprob - expected[prompt[p]]) < TOLERANCE
        assert [t for t, _ in got.top] == list(np.argsort(-expected, kind="stable")[:3])
        assert np.allclose([lp for _, lp in got.top], np.sort(expected)[::-1][:3], atol=TOLERANCE)
    assert r.samples[0].generated == plain.samples[0].generated  # scoring changes no token
    assert plain.prompt_logprobs == []  # nobody asked


def test_a_bias_naming_an_id_past_the_vocabulary_fails_its_request_alone(tiny):
    vocab = tiny[1].vocab_size
    bad = request(tiny, 0, QUESTIONS[0], 3, Sampling(logit_bias=((vocab + 5, 100.0),)))
    penalised = request(tiny, 1, QUESTIONS[1], 3, Sampling(presence_penalty=0.1))
    run("cell", tiny, [bad, penalised])
    assert bad.samples[0].finish_reason == "error" and f"id {vocab + 5}" in bad.samples[0].error
    (alone,) = run("cell", tiny, [request(tiny, 1, QUESTIONS[1], 3, Sampling(presence_penalty=0.1))])
    assert penalised.samples[0].generated == alone.samples[0].generated  # its row got nothing of the bias


def test_kept_logit_biases_are_bounded_in_ids_and_still_answer_right(monkeypatch):
    # A client may send many vocabulary-wide biases: what is kept after their requests end stays bounded,
    # and an evicted bias is built again, the same (the tuple itself is the oracle).
    from kvlayout.engines import shaping

    monkeypatch.setattr(shaping, "biases", type(shaping.biases)())
    monkeypatch.setattr(shaping, "BIAS_IDS_KEPT", 1000)
    vocab = 400
    wide = [tuple((t, float(i % 7) - 3.0) for t in range(vocab)) for i in range(6)]
    for bias in wide:
        shaping.bias_entries(bias, vocab)
        assert sum(len(k[0]) for k in shaping.biases.values()) <= 1000
    assert len(shaping.biases) == 2  # 2 x 400 ids fit, a third would not
    ids, amounts, outside = shaping.bias_entries(wide[0], vocab)  # evicted long ago: built again
    assert ids.tolist() == [t for t, _ in wide[0]] and amounts.tolist() == [a for _, a in wide[0]]
    assert outside is None
