"""engines.drafts on its own: the n-gram index against a scan, the verification rule against the model's
distribution, and the pacing's choices against worked cases."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlayout.engines import Sampling, drafts
from kvlayout.engines.sampling import sample_token
from tests.engines.conftest import SYSTEM, cache_for


def scanned(tokens: list[int], k: int) -> tuple[list[int], int]:
    """The oracle of NgramIndex.propose: the longest suffix (at most 3) seen ending earlier, its latest
    occurrence, and the k tokens after it; by a plain scan."""
    last = len(tokens) - 1
    for n in range(min(drafts.MAX_NGRAM, len(tokens)), 0, -1):
        suffix = tokens[len(tokens) - n :]
        for e in range(last - 1, n - 2, -1):
            if tokens[e - n + 1 : e + 1] == suffix:
                return tokens[e + 1 : e + 1 + k], n
    return [], 0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=40), st.integers(1, 6), st.integers(1, 8))
def test_the_index_proposes_what_a_scan_finds_as_the_tokens_grow(tokens, k, start):
    index = drafts.NgramIndex()
    for end in range(min(start, len(tokens)), len(tokens) + 1):  # proposed as a sample grows, step by step
        assert index.propose(tokens[:end], k) == scanned(tokens[:end], k)


def chi_square_passes(counts: np.ndarray, expected: np.ndarray) -> bool:
    """Whether observed `counts` fit `expected` (pooled to bins of at least 5 expected) at the 0.1% level
    (Wilson-Hilferty's approximation of the chi-square quantile)."""
    order = np.argsort(-expected)
    big = [i for i in order if expected[i] >= 5]
    rest = [i for i in order if expected[i] < 5]
    obs = np.append(counts[big], counts[rest].sum())
    exp = np.append(expected[big], expected[rest].sum())
    stat = float(((obs - exp) ** 2 / np.maximum(exp, 1e-12)).sum())
    dof = len(obs) - 1
    z = 3.09  # the 0.999 quantile of the normal
    critical = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
    return stat < critical


def tiny_rows(tiny) -> np.ndarray:
    """Two rows of the tiny preset's logits `[2, V]` at the end of a prompt, as a step gives them."""
    model, args, tok = tiny
    ids = tok.encode(SYSTEM + "Q: why?\nA:")
    cache = cache_for("cell", args)
    bc = cache.as_batch_control()
    sid = bc.seq_new()
    assert bc.declare_step([sid] * len(ids))
    logits = model(ids, list(range(len(ids))), cache, rows=[len(ids) - 2, len(ids) - 1])
    return np.array(logits.astype(mx.float32))


def softmax(row: np.ndarray, temperature: float) -> np.ndarray:
    z = row.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    return p / p.sum()


def test_a_draft_is_kept_with_its_probability_and_else_the_token_follows_the_rest_of_the_distribution(tiny):
    """The rule of speculative sampling for a deterministic draft, on the tiny preset's logits: the first
    token follows p (the draft x among it, kept with p(x)), the token after a kept draft follows the
    next row's distribution; and each is the token the sample draws without speculation (the seed
    contract)."""
    rows = tiny_rows(tiny)
    sampling = Sampling(temperature=1.5, top_p=1.0)
    p0, p1 = softmax(rows[0], 1.5), softmax(rows[1], 1.5)
    x = int(np.argsort(-p0)[1])  # a draft the model often rejects
    n = 4000
    first, second = np.zeros_like(p0), np.zeros_like(p1)
    for seed in range(n):
        kept = drafts.verify([x], rows, sampling, np.random.default_rng([seed]))
        plain = np.random.default_rng([seed])
        assert kept[0] == sample_token(rows[0], 1.5, 1.0, plain)
        first[kept[0]] += 1
        if len(kept) == 2:
            assert kept[0] == x
            assert kept[1] == sample_token(rows[1], 1.5, 1.0, plain)
            second[kept[1]] += 1
        else:
            assert len(kept) == 1 and kept[0] != x
    assert chi_square_passes(first, n * p0)
    assert chi_square_passes(second, second.sum() * p1)
    assert chi_square_passes(np.array([first[x], n - first[x]]), n * np.array([p0[x], 1 - p0[x]]))


def test_greedy_verification_keeps_drafts_while_they_are_the_argmax_then_the_argmax():
    ids = np.array([5, 7, 9, 2])
    rng = np.random.default_rng(0)
    assert drafts.verify([5, 7, 1], ids, Sampling(), rng) == [5, 7, 9]
    assert drafts.verify([5, 7, 9], ids, Sampling(), rng) == [5, 7, 9, 2]
    assert drafts.verify([4], ids[:2], Sampling(), rng) == [5]


def test_the_step_cost_fit_finds_the_slope_of_timed_steps_and_the_prior_without_them():
    cost = drafts.StepCost(timed=True, draft_tokens=4)
    assert cost.slope() == drafts.PRIOR_SLOPE
    for _ in range(40):
        for fed in (1, 2, 5, 3):
            cost.observe(fed, 0.010 + 0.002 * fed)  # c1 / c0 = 0.2
    assert abs(cost.slope() - 0.2) < 0.02
    linear = drafts.StepCost(timed=True, draft_tokens=4)
    for _ in range(40):
        for fed in (1, 5):
            linear.observe(fed, 0.004 * fed)  # all slope: a token costs its full share
    assert linear.slope() > 5
    untimed = drafts.StepCost(timed=False, draft_tokens=4)
    untimed.observe(5, 1.0)
    assert untimed.slope() == drafts.PRIOR_SLOPE


def pacing_with_slope(slope: float) -> drafts.Pacing:
    pacing = drafts.Pacing(4, timed=True)
    for _ in range(60):
        for fed in (1, 3, 5):
            pacing.cost.observe(fed, 0.01 * (1 + slope * fed))
    return pacing


def draft_of(pacing: drafts.Pacing, state: drafts.DraftState, batch: int) -> list[int]:
    pacing.choose([(state, [1, 2, 3, 4], 3)], batch, batch)
    return state.draft


def test_drafting_stops_where_it_does_not_pay_large_batches_and_a_costly_token():
    flat, costly = pacing_with_slope(0.05), pacing_with_slope(50.0)
    assert len(draft_of(flat, drafts.DraftState(), 1)) >= 2  # a step that barely grows: draft
    assert draft_of(flat, drafts.DraftState(), 64) == []  # a large batch: each token is work already
    assert draft_of(costly, drafts.DraftState(), 1) == []  # each token costs its full share


def test_a_sample_whose_drafts_are_rejected_stops_drafting_and_probes_again_later_and_one_kept_drafts_deeper():
    pacing = pacing_with_slope(0.3)  # a draft token must be kept one time in four or so to pay
    state = drafts.DraftState()
    for _ in range(12):
        if draft_of(pacing, state, 1):
            pacing.verified(state, 0)
    assert draft_of(pacing, state, 1) == []
    idle = 0
    while not draft_of(pacing, state, 1):  # fades back towards the prior: a probe
        idle += 1
        assert idle < 2000
    assert idle > 5
    for _ in range(12):
        if draft_of(pacing, state, 1):
            pacing.verified(state, len(state.draft))
    assert draft_of(pacing, state, 1) == [1, 2, 3, 4]


def test_a_sample_has_room_for_fewer_drafts_than_tokens_left():
    from kvlayout.engines import make_requests

    (r,) = make_requests([[1, 2]], [5], [1], 0)
    assert drafts.room(r, r.samples[0], 4) == 4
    r.samples[0].generated = [1, 2, 3]
    assert drafts.room(r, r.samples[0], 4) == 1
    r.samples[0].generated = [1, 2, 3, 4]
    assert drafts.room(r, r.samples[0], 4) == 0


def test_where_a_step_costs_little_more_up_to_a_width_and_then_jumps_the_drafts_fill_it_and_stop():
    """Batch 8 on a CPU's matmuls, as measured: 16 tokens cost 1.15x 8 tokens, 24 cost 1.65x. With
    eight sequences whose drafts are kept 70% of the time, one draft each pays, a second does not."""
    measured = {8: 0.151, 16: 0.173, 24: 0.249, 32: 0.28, 40: 0.309}
    pacing = drafts.Pacing(4, timed=True)
    for _ in range(30):
        for fed, seconds in measured.items():
            pacing.cost.observe(fed, seconds)
    states = [drafts.DraftState() for _ in range(8)]
    for state in states:
        state.acceptance[3].kept, state.acceptance[3].tried = 70.0, 100.0  # 70 of the 100 reached were kept
    pacing.choose([(state, [1, 2, 3, 4], 3) for state in states], 8, 8)
    assert [len(state.draft) for state in states] == [1] * 8


def test_a_width_never_timed_is_never_guessed_cheaper_than_the_width_every_step_had():
    """32 sequences decoding, every step 32 wide: one more token must look dearer, however the line
    through the timings and the prior runs, so nobody is taken off the device draws for nothing."""
    pacing = drafts.Pacing(4, timed=True)
    for seconds in (0.30, 0.34, 0.29, 0.31, 0.33):
        pacing.cost.observe(32, seconds)
    assert pacing.extra_cost(32, 1) > 0
    assert pacing.threshold(32, 32) > pacing.rate(drafts.DraftState(), drafts.MAX_NGRAM)
