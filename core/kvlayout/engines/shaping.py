"""What a sample's next token is drawn from on the host path: its row of logits, shaped, and the logprobs it reports.

A request may shape its samples' logits (engines.records.Sampling): `logit_bias`
adds a fixed amount to chosen ids, `presence_penalty` and `frequency_penalty`
subtract for every id the sample generated (once, and once per time: OpenAI's
rule), and a sample's `constraint` (a grammar, kvlayout.grammar) allows only
the ids that keep its output valid. All of that is applied to the logits on
the device, one `[S, V]` matrix for the step's shaped samples, before the rows
reach the host's sampler (engines.sampling). A sample asking for `logprobs`
gets, for each token it keeps, the model's log-softmax of that token and of
the `logprobs` most likely ones: the raw logits', before any shaping or
temperature, as OpenAI reports them.

A constraint's allowed ids are filled on the host while the device computes
the step (`HostDraw.read` queues the logits first): the batch does not wait
for the grammar, only for whichever takes longer.

A sample drawn ahead on the device (engines.ahead) is greedy and plain: a
shaped sample, or one reporting logprobs, is drawn here, on the host path.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Sequence
from typing import Protocol

import attrs
import mlx.core as mx
import numpy as np

from kvlayout.engines.records import Request, Sample, Sampling
from kvlayout.engines.sampling import sample_token
from kvlayout.errors import SequenceError


class Constraint(Protocol):
    """What a sample may generate next (kvlayout.grammar's matchers implement it)."""

    def fill(self, words: np.ndarray) -> None:
        """Write the allowed next ids into `words`, an int32 row `[ceil(V/32)]` (bit t % 32 of word
        t // 32 set: id t allowed); never all clear (a finished grammar allows its EOS ids)."""

    def accept(self, token: int) -> None:
        """The sample keeps `token` (one `fill` allowed)."""

    @property
    def complete(self) -> bool:
        """Whether what the sample kept so far is a whole match (its end-of-sequence ids are allowed)."""


@attrs.frozen
class TokenLogprob:
    """A kept token's log-probability under the model, and the most likely ids' (most likely first)."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


Pick = tuple[Request, Sample, int]  # a sample to draw for, and its row of the step's host logits


def shapes(sampling: Sampling, sample: Sample) -> bool:
    """Whether `sample`'s logits are shaped before its token is drawn."""
    return bool(sampling.logit_bias or sampling.presence_penalty or sampling.frequency_penalty
                or sample.constraint is not None)


def on_host_only(sampling: Sampling, sample: Sample) -> bool:
    """Whether `sample` must be drawn on the host path (shaped, or reporting logprobs)."""
    return sampling.logprobs is not None or shapes(sampling, sample)


class HostDraw:
    """The host path's draw for one step: `read` the step's host rows, then `draw` each pick's token.

    `picks`: (request, sample, row) in the order tokens are drawn; `default`: the engine's
    Sampling, for requests that bring none."""

    def __init__(self, picks: Sequence[Pick], default: Sampling):
        self.picks = list(picks)
        self.settings = [r.sampling or default for r, _, _ in self.picks]
        self.shaped = [i for i, (s, (_, x, _)) in enumerate(zip(self.settings, self.picks)) if shapes(s, x)]
        self.logged = [i for i, s in enumerate(self.settings) if s.logprobs is not None]
        self.rows: np.ndarray | None = None  # [R, V] float32: the step's host rows, as the model gave them
        self.shaped_rows: np.ndarray | None = None  # [len(shaped), V]
        self.logprob_rows: np.ndarray | None = None  # [len(logged), V]

    def read(self, logits: mx.array) -> HostDraw:
        """Bring what the draw needs of `logits` `[R, V]` to the host: the raw rows, the shaped samples'
        rows (shaped on the device) and the log-softmax rows of those reporting logprobs. Evaluating
        them is the step's sync point; constraints fill their masks meanwhile."""
        rows = logits.astype(mx.float32)
        if not self.shaped and not self.logged:
            self.rows = np.array(rows)
            return self
        mx.async_eval(rows)  # the forward runs while the host fills the grammar masks
        out = [rows]
        if self.shaped:
            out.append(self._shape(rows))
        if self.logged:
            picked = rows[mx.array([self.picks[i][2] for i in self.logged], dtype=mx.int32)]
            out.append(picked - mx.logsumexp(picked, axis=-1, keepdims=True))  # [L, V]
        mx.eval(out)
        if len(self.shaped) < len(self.picks):  # some pick draws from its raw row
            self.rows = np.array(out[0])
        if self.shaped:
            self.shaped_rows = np.array(out[1])
        if self.logged:
            self.logprob_rows = np.array(out[-1])
        return self

    def draw(self) -> list[tuple[int, TokenLogprob | None]]:
        """Each pick's token (its own generator draws once) and its logprob record (None when not asked)."""
        shaped_at = {i: j for j, i in enumerate(self.shaped)}
        logged_at = {i: j for j, i in enumerate(self.logged)}
        out = []
        for i, ((_, sample, row), sampling) in enumerate(zip(self.picks, self.settings)):
            x = self.shaped_rows[shaped_at[i]] if i in shaped_at else self.rows[row]
            token = sample_token(x, sampling.temperature, sampling.top_p, sample.rng)
            lp = None
            if i in logged_at:
                lp = token_logprob(self.logprob_rows[logged_at[i]], token, sampling.logprobs)
            out.append((token, lp))
        return out

    def _shape(self, rows: mx.array) -> mx.array:
        """The shaped samples' rows `[S, V]`: biased and penalised, then masked by their constraints."""
        vocab = rows.shape[-1]
        picks = [self.picks[i] for i in self.shaped]
        x = rows[mx.array([row for _, _, row in picks], dtype=mx.int32)]  # [S, V]
        ids, amounts = additive(picks, [self.settings[i] for i in self.shaped], vocab)
        if ids.size:
            x = (x.reshape(-1).at[mx.array(ids)].add(mx.array(amounts))).reshape(x.shape)
        constrained = [j for j, (_, sample, _) in enumerate(picks) if sample.constraint is not None]
        if constrained:
            words = np.zeros((len(picks), -(-vocab // 32)), dtype=np.int32)
            words[[j for j in range(len(picks)) if j not in constrained]] = -1  # unconstrained: every id
            for j in constrained:
                picks[j][1].constraint.fill(words[j])
            x = mx.where(allowed(mx.array(words), vocab), x, -mx.inf)
        return x


def additive(picks: Sequence[Pick], settings: Sequence[Sampling], vocab: int) -> tuple[np.ndarray, np.ndarray]:
    """The amounts added to the shaped samples' logits as flat indices into `[S, V]` and their values
    (repeated indices add up): each sample's logit_bias, and its penalties over what it generated."""
    ids: list[np.ndarray] = []
    amounts: list[np.ndarray] = []
    for j, ((request, sample, _), s) in enumerate(zip(picks, settings)):
        base = j * vocab
        if s.logit_bias:
            bias_ids, bias_amounts, outside = bias_entries(s.logit_bias, vocab)
            if outside is not None:  # it would land on another sample's row
                raise SequenceError(f"request {request.index}: logit_bias names id {outside}, outside the "
                                    f"vocabulary (0..{vocab - 1})")
            ids.append(base + bias_ids)
            amounts.append(bias_amounts)
        if (s.presence_penalty or s.frequency_penalty) and sample.generated:
            seen, counts = np.unique(np.asarray(sample.generated, dtype=np.int64), return_counts=True)
            ids.append(base + seen)
            amounts.append((-s.presence_penalty - s.frequency_penalty * counts).astype(np.float32))
    if not ids:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.float32)
    return np.concatenate(ids), np.concatenate(amounts)


# Requests' logit_bias arrays kept (a running request's is found again every step), at most this many
# biases and ids in all: each entry holds its request's tuple (so its id is not reused), ~130 bytes an
# id as Python objects, which a finished request no longer holds; a vocabulary-wide bias is ~50k ids.
BIASES_KEPT = 256
BIAS_IDS_KEPT = 1 << 18
biases: collections.OrderedDict[int, tuple] = collections.OrderedDict()  # id(logit_bias) -> (it, vocab, arrays)


def bias_entries(logit_bias: tuple[tuple[int, float], ...], vocab: int) -> tuple[np.ndarray, np.ndarray, int | None]:
    """A logit_bias as (ids, amounts) arrays, and an id outside `vocab` (None: none): built once per request's
    bias and found again by identity, so a step costs nothing per id (a bias may name thousands)."""
    kept = biases.get(id(logit_bias))
    if kept is not None and kept[0] is logit_bias and kept[1] == vocab:
        biases.move_to_end(id(logit_bias))
        return kept[2]
    ids = np.fromiter((t for t, _ in logit_bias), dtype=np.int64, count=len(logit_bias))
    amounts = np.fromiter((a for _, a in logit_bias), dtype=np.float32, count=len(logit_bias))
    outside = ids[(ids < 0) | (ids >= vocab)]
    entries = ids, amounts, int(outside[0]) if outside.size else None
    biases[id(logit_bias)] = (logit_bias, vocab, entries)  # holding the tuple: its id is not reused while kept
    while len(biases) > BIASES_KEPT or (len(biases) > 1 and sum(len(k[0]) for k in biases.values()) > BIAS_IDS_KEPT):
        biases.popitem(last=False)  # the least recently used; the newest always stays
    return entries


@functools.cache
def bit_positions(vocab: int) -> tuple[mx.array, mx.array]:
    """Each id's word and bit in a bitmask row: `[V]` `t // 32` and `t % 32`."""
    t = mx.arange(vocab, dtype=mx.int32)
    return t // 32, t % 32


def allowed(words: mx.array, vocab: int) -> mx.array:
    """`[S, V]` bool from bit masks `[S, ceil(V/32)]` int32: id t is allowed when bit t % 32 of word t // 32 is set."""
    word, bit = bit_positions(vocab)
    return (mx.right_shift(words[:, word], bit[None]) & 1).astype(mx.bool_)


def token_logprob(logprobs: np.ndarray, token: int, top: int) -> TokenLogprob:
    """`token`'s entry of a log-softmax row `[V]`, with the `top` most likely ids (ties: lower id first)."""
    alternatives: tuple[tuple[int, float], ...] = ()
    if top:
        top = min(top, logprobs.size)
        kth = np.partition(logprobs, logprobs.size - top)[logprobs.size - top]  # the top-th largest value
        above = np.flatnonzero(logprobs > kth)
        ties = np.flatnonzero(logprobs == kth)[: top - above.size]  # lower ids first, as a stable sort
        head = sorted(np.concatenate([above, ties]).tolist(), key=lambda t: (-logprobs[t], t))
        alternatives = tuple((t, float(logprobs[t])) for t in head)
    return TokenLogprob(token, float(logprobs[token]), alternatives)


def score_prompt(request: Request, start: int, logits: mx.array) -> None:
    """Record in `request.prompt_logprobs` the logprobs of its prompt tokens `start + 1 ...` from the
    logits `[E, V]` of positions `start ...` (each row predicts the next position's token), with
    `request.score_prompt` alternatives each. Taken on the device: only `[E, top]` reaches the host."""
    prompt, top = request.prompt, request.score_prompt
    if not request.prompt_logprobs:
        request.prompt_logprobs = [None] * len(prompt)
    e = logits.shape[0]
    x = logits.astype(mx.float32)
    norm = mx.logsumexp(x, axis=-1, keepdims=True)  # [E, 1]
    nxt = mx.array(prompt[start + 1 : start + 1 + e], dtype=mx.int32)[:, None]  # [E, 1]
    out = [mx.take_along_axis(x, nxt, axis=-1) - norm]
    if top:
        ids = mx.argpartition(-x, kth=top - 1, axis=-1)[:, :top]  # [E, top], in no order
        out += [ids, mx.take_along_axis(x, ids, axis=-1) - norm]
    mx.eval(out)
    chosen = np.array(out[0])[:, 0]
    ids, values = (np.array(out[1]).tolist(), np.array(out[2]).tolist()) if top else ((), ())
    for i in range(e):
        alternatives: tuple[tuple[int, float], ...] = ()
        if top:
            alternatives = tuple(sorted(zip(ids[i], values[i]), key=lambda p: (-p[1], p[0])))
        request.prompt_logprobs[start + 1 + i] = TokenLogprob(prompt[start + 1 + i], float(chosen[i]), alternatives)
