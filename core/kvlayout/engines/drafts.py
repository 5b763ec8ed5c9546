"""Speculative decoding by n-gram drafts (prompt lookup): what a sample proposes, what a step verifies.

A decoding sample whose last few tokens occurred before in its own prompt
and output proposes the tokens that followed them then (`NgramIndex`). The
step feeds its last token and the drafts on the one flat token axis, and the
logits of every one of those positions come back: each row says what the
model draws after the tokens up to it. `verify` draws, row by row, exactly
the token the sample would have drawn there without speculation (its own
generator, one number per kept token, the host sampler of engines.sampling),
and goes on while that token is the draft. So a draft x is kept with
probability p(x), and otherwise the token is drawn from p with x removed and
renormalised: the rule of speculative sampling for a deterministic draft.
More than that, the seed contract is unchanged: with the same logits, a
sample generates the same tokens with speculation on or off, at any
temperature. (Logits of a step carrying drafts may differ from a one-token
step's in the last bits, as a prefill chunk's do.)

Rejected positions are taken out of the cache again before the next step
(`seq_rm` on cells, `rewind` on a seq cache): nothing is copied.

Whether drafting pays is `Pacing`'s call, step by step: a draft token costs
the whole step a little (the fitted slope of step time against tokens fed)
and gains its chance of being kept (a sample's acceptance rate, learnt as it
goes, compounded along the draft). A draft token is added while its expected
gain per second beats the step's throughput without it: at one sequence on a
device whose step barely grows with tokens it drafts freely; in a large
batch, or where each token costs its full share (4-bit matmuls on a CPU), or
where drafts are rarely kept, it stops. The slope is fitted from timed
steps, so the choice depends on timing: under tensor parallelism, where every
rank must carry the same step, the prior slope stands in for the fit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs
import mlx.core as mx
import numpy as np

from kvlayout.engines.options import EngineOptions
from kvlayout.engines.records import Agree, Request, Sample, Sampling, Stats, same_tokens
from kvlayout.engines.sampling import sample_token
from kvlayout.engines.shaping import on_host_only

MAX_NGRAM = 3  # the longest suffix matched; a longer match is tried first
PRIOR_SLOPE = 0.1  # step time per extra token, as a fraction of a one-token step, before any is timed


class NgramIndex:
    """Where each n-gram (n <= MAX_NGRAM) of a growing token list last ended, up to its newest token.

    Built lazily as the list grows (a sample's tokens only grow), so a step costs a few dict
    updates, not a scan of the history."""

    def __init__(self):
        self.last: dict[tuple[int, ...], int] = {}
        self.indexed = 0  # n-grams ending before this position are recorded

    def propose(self, tokens: Sequence[int], k: int) -> tuple[list[int], int]:
        """Up to `k` tokens that followed the latest earlier occurrence of the longest suffix of
        `tokens` seen before, and that suffix's length; ([], 0) when none was."""
        end = len(tokens) - 1  # the suffix ends here: record every n-gram ending before it
        for i in range(self.indexed, end):
            for n in range(1, min(MAX_NGRAM, i + 1) + 1):
                self.last[tuple(tokens[i - n + 1 : i + 1])] = i
        self.indexed = max(self.indexed, end)
        for n in range(min(MAX_NGRAM, len(tokens)), 0, -1):
            e = self.last.get(tuple(tokens[len(tokens) - n :]))
            if e is not None:
                return list(tokens[e + 1 : e + 1 + k]), n
        return [], 0


@attrs.define
class Acceptance:
    """How often a sample's drafts are kept: kept / tried, tried counting each draft position
    reached (a rejection ends the run), decayed so that the recent past speaks."""

    kept: float = 0.0
    tried: float = 0.0

    def note(self, drafted: int, accepted: int, decay: float) -> None:
        self.kept = self.kept * decay + accepted
        self.tried = self.tried * decay + accepted + (accepted < drafted)

    def fade(self, decay: float) -> None:
        self.kept *= decay
        self.tried *= decay


@attrs.define(eq=False)
class DraftState:
    """One sample's drafting: its n-gram index, its acceptance by the length of the suffix a draft was
    found by (a longer match is a surer draft), and the draft its next step verifies."""

    index: NgramIndex = attrs.field(factory=NgramIndex)
    acceptance: dict[int, Acceptance] = attrs.field(factory=lambda: {n: Acceptance() for n in range(1, MAX_NGRAM + 1)})
    draft: list[int] = attrs.field(factory=list)
    ngram: int = 0  # the length of the suffix the draft was found by


def may_draft(request: Request, sample: Sample, options: EngineOptions) -> bool:
    """Whether `sample` may speculate: its logits are not shaped and it reports no logprobs (those
    are drawn from per-token state a draft would have to run ahead of; engines.shaping), and it has
    tokens left to gain."""
    return (not on_host_only(request.sampling or options.sampling, sample)
            and room(request, sample, options.speculate_tokens) > 0)


def pacing_for(options: EngineOptions) -> Pacing | None:
    """The engine's Pacing when `options` speculate (None when off): timed on the steps the host waited
    for whole, unless ranks must build the same steps (tensor-parallel: the prior slope stands)."""
    if options.speculate != "ngram":
        return None
    return Pacing(options.speculate_tokens, timed=options.agree is same_tokens)


class StepCost:
    """Step time against tokens fed. A line `c0 + c1 * T` fitted by weighted least squares over recent
    steps, prompt chunks included (the older, the less weight), pulled towards `PRIOR_SLOPE` where the steps timed so
    far do not tell the slope apart (all of one width); and each width's own recent mean, where it was
    timed: a CPU's matmuls, say, cost nearly nothing more up to some width and then jump, which a
    line does not follow."""

    DECAY = 0.95
    PRIOR_WEIGHT = 0.5
    LINE_WEIGHT = 1.0  # the line's say beside a width's own timings, in steps

    def __init__(self, timed: bool, draft_tokens: int):
        self.timed, self.k = timed, draft_tokens
        self.sums = np.zeros(5)  # sum of w, wT, wT^2, wy, wTy
        self.widths: dict[int, list[float]] = {}  # fed -> [weight, weighted seconds]
        self.fitted: tuple[float, float] | None = None  # line(), until the next step is timed

    def observe(self, fed: int, seconds: float) -> None:
        if not (self.timed and fed > 0 and seconds > 0):
            return
        self.fitted = None
        self.sums = self.sums * self.DECAY + np.array([1.0, fed, fed * fed, seconds, fed * seconds])
        for width in list(self.widths):
            kept = self.widths[width]
            kept[0] *= self.DECAY
            kept[1] *= self.DECAY
            if kept[0] < 0.01:  # long not seen: the line speaks for it again
                del self.widths[width]
        kept = self.widths.setdefault(fed, [0.0, 0.0])
        kept[0] += 1.0
        kept[1] += seconds

    def line(self) -> tuple[float, float]:
        """(c0, c1) in seconds; (1, PRIOR_SLOPE) before any step was timed."""
        if self.fitted is None:
            self.fitted = self.fit()
        return self.fitted

    def fit(self) -> tuple[float, float]:
        if self.sums[0] < 1e-9:
            return 1.0, PRIOR_SLOPE
        # The prior as pseudo-steps at 1 and at 1 + k tokens, on the level of the steps timed.
        w, t, _, y, _ = self.sums
        level = (y / w) / (1 + PRIOR_SLOPE * t / w)  # c0 as the prior would put it
        fed = np.array([1.0, 1.0 + self.k])
        seconds = level * (1 + PRIOR_SLOPE * fed)
        prior = self.PRIOR_WEIGHT * np.array([len(fed), fed.sum(), (fed * fed).sum(), seconds.sum(),
                                              (fed * seconds).sum()])
        w, t, t2, y, ty = self.sums + prior
        c1 = max((w * ty - t * y) / (w * t2 - t * t), 0.0)
        c0 = (y - c1 * t) / w
        return max(c0, 1e-6 * level), c1  # c0 <= 0: all slope, every token its full share

    def slope(self) -> float:
        """c1 / c0: what one more token adds to a step, as a fraction of the step's fixed cost."""
        c0, c1 = self.line()
        return c1 / c0

    def seconds(self, fed: int) -> float:
        """A step of `fed` tokens: its width's recent mean, with the line's prediction as a prior."""
        c0, c1 = self.line()
        predicted = c0 + c1 * fed
        kept = self.widths.get(fed)
        if kept is None:
            return predicted
        return (kept[1] + self.LINE_WEIGHT * predicted) / (kept[0] + self.LINE_WEIGHT)


class Pacing:
    """Which draft tokens a step carries (see the module's doc): the engine-wide half of drafting.

    Acceptance is learnt per sample and, as its prior, per matched suffix length across all
    samples; both fade while nobody drafts, so a workload that turns repetitive is noticed again
    (a fading estimate climbs back to the prior and a one-token probe follows)."""

    SAMPLE_DECAY = 0.8  # per verified draft: a sample's recent drafts speak
    IDLE_DECAY = 0.95  # per step a sample does not draft: back towards the shared prior
    SHARED_DECAY = 0.995  # the shared prior per step, towards an even chance
    PRIOR_KEPT, PRIOR_TRIED = 1.0, 2.0
    # Drafting must promise this much more work per second than not drafting: acceptance is learnt
    # from a few drafts, and where a token costs nearly a step (4-bit on a CPU) a hopeful guess loses.
    MARGIN = 0.1

    def __init__(self, draft_tokens: int, timed: bool):
        self.k = draft_tokens
        self.cost = StepCost(timed, draft_tokens)
        self.shared = {n: Acceptance() for n in range(1, MAX_NGRAM + 1)}

    def rate(self, state: DraftState, ngram: int) -> float:
        """The chance that `state`'s next draft token, found by a suffix of length `ngram`, is kept."""
        shared = self.shared[ngram]
        prior = (shared.kept + self.PRIOR_KEPT) / (shared.tried + self.PRIOR_TRIED)
        a = state.acceptance[ngram]
        return (a.kept + 2.0 * prior) / (a.tried + 2.0)

    def extra_cost(self, fed: int, more: int) -> float:
        """What `more` draft tokens add to a step feeding `fed`, as a fraction of its time."""
        return self.cost.seconds(fed + more) / self.cost.seconds(fed) - 1.0

    def threshold(self, useful: float, fed: int) -> float:
        """The least chance of being kept at which one more draft token pays in a step feeding
        `fed` tokens for `useful` tokens of work: its gain per time against the step's, by MARGIN."""
        return useful * ((1.0 + self.extra_cost(fed, 1)) * (1.0 + self.MARGIN) - 1.0)

    def worth_trying(self, state: DraftState, fed: int) -> bool:
        """Whether a sample's next step might draft (so its token should be read on the host, not
        drawn ahead): its best chance beats the threshold of a step like this one."""
        return self.rate(state, MAX_NGRAM) > self.threshold(fed, fed)

    def choose(self, candidates: list[tuple[DraftState, list[int], int]], useful: float, fed: int) -> None:
        """Set each candidate's `draft` (state, proposal, suffix length) to the head of its proposal
        worth verifying in a step feeding `fed` tokens for `useful` tokens of work: the draft tokens,
        surest first, as far as the step's expected work per time is greatest."""
        heads: list[tuple[float, int, int]] = []  # (chance, candidate, depth)
        for c, (state, proposal, ngram) in enumerate(candidates):
            state.draft, state.ngram = [], ngram
            a = self.rate(state, ngram) if proposal else 0.0
            heads += [(a ** (j + 1), c, j) for j in range(len(proposal))]
        heads.sort(key=lambda h: (-h[0], h[2]))  # a deeper token of a sample after its shallower ones
        best, most, gain = 0, float(useful), 0.0
        base = self.cost.seconds(fed)
        for m, (chance, _, _) in enumerate(heads, 1):
            gain += chance
            value = (useful + gain) * base / self.cost.seconds(fed + m)
            if value >= most:
                best, most = m, value
        if most < useful * (1.0 + self.MARGIN):
            best = 0
        taken = [0] * len(candidates)
        for _, c, _ in heads[:best]:
            taken[c] += 1
        for c, (state, proposal, _) in enumerate(candidates):
            state.draft = proposal[: taken[c]]
            if not state.draft:
                for a in state.acceptance.values():
                    a.fade(self.IDLE_DECAY)
        if not best:
            for shared in self.shared.values():
                shared.fade(self.SHARED_DECAY)

    def verified(self, state: DraftState, accepted: int) -> None:
        """`state`'s draft was verified and its first `accepted` tokens kept; the draft is spent."""
        drafted = len(state.draft)
        state.acceptance[state.ngram].note(drafted, accepted, self.SAMPLE_DECAY)
        self.shared[state.ngram].note(drafted, accepted, self.SHARED_DECAY)
        state.draft = []


def room(request: Request, sample: Sample, k: int) -> int:
    """Draft tokens a sample may carry: at most `k`, and fewer than the tokens it has left (a step
    keeps at most every draft and one more token)."""
    return max(0, min(k, request.max_tokens - len(sample.generated) - 1))


def verify(draft: Sequence[int], rows: np.ndarray, sampling: Sampling, rng: np.random.Generator) -> list[int]:
    """The tokens a sample keeps from a step that fed its last token and `draft`: `rows` `[d + 1, V]`
    are those positions' logits (or, greedy, their argmax ids `[d + 1]`). Row by row, the token the
    sample draws there (its generator, as without speculation), while it is the draft's."""
    kept: list[int] = []
    for i in range(len(draft) + 1):
        token = int(rows[i]) if rows.ndim == 1 else sample_token(rows[i], sampling.temperature, sampling.top_p, rng)
        kept.append(token)
        if i == len(draft) or token != draft[i]:
            break
    return kept


def agreed(agree: Agree, kept: list[list[int]], widths: list[int]) -> list[list[int]]:
    """Each verified draft's kept tokens as every rank takes them (`agree`: rank 0's, tensor-parallel):
    one list, each padded with -1 to its step positions `widths`, so every rank's has one length."""
    flat = agree([t for got, n in zip(kept, widths) for t in got + [-1] * (n - len(got))])
    out, at = [], 0
    for n in widths:
        out.append([t for t in flat[at : at + n] if t >= 0])
        at += n
    return out


def record_kept(tokens: list[int], drafted: int, stats: Stats, advance: Callable[[int], bool]) -> int:
    """Record a verified draft's kept `tokens` in order through `advance` until one ends the sample
    (True), counting in `stats` the `drafted` tokens and those of them recorded (all but the last of
    `tokens` are the draft's): how many were."""
    recorded = len(tokens) - 1
    for i, t in enumerate(tokens):
        if advance(t):
            recorded = min(i + 1, len(tokens) - 1)
            break
    stats.drafted_tokens += drafted
    stats.accepted_tokens += recorded
    return recorded


def verify_rows(logits: mx.array, greedy: bool) -> mx.array:
    """What `verify` needs of a sample's rows `[d + 1, V]`: greedy, the argmax ids (a few bytes to the
    host, not the rows); else the float32 rows."""
    return mx.argmax(logits, axis=-1) if greedy else logits.astype(mx.float32)
