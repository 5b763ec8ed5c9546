"""Generation through a seq layout: one sequence at a time (SequenceControl face)."""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Sequence

import attrs
import numpy as np

from kvlayout.engines import ahead, drafts, seq_state
from kvlayout.engines.interface import Stop, run_steps
from kvlayout.engines.options import EngineOptions
from kvlayout.engines.records import Request, Sample, end_sample, record_token
from kvlayout.engines.recovery import guarded_forward
from kvlayout.engines.shaping import HostDraw, TokenLogprob, score_prompt
from kvlayout.errors import CapacityError, ForwardFailed, Interrupted


@attrs.define(eq=False)
class Generating:
    """The sample in the cache: its tokens (prompt, then what it generated), the first
    `cached` of them in the cache, and whether its last forward failed once already.

    `drawn`: its next token, drawn on the device and not read yet (engines.ahead); while it is
    set, every one of `tokens` is in the cache and the next forward feeds that token.
    """

    request: Request
    sample: Sample
    tokens: list[int]
    cached: int
    retried: bool = False
    drawn: ahead.Drawn | None = None
    drafting: drafts.DraftState = attrs.field(factory=drafts.DraftState)  # speculation (engines.drafts)
    plain: bool | None = None  # greedy and plain with the engine pipelining (ahead.drawn_on_device): asked once


class SeqEngine:
    """One sequence at a time through a SequenceControl cache.

    Every sample regenerates from its prompt: the cache is cleared before each.
    A step writes at most `chunk` tokens, and never more than the layout's
    face says one step may carry (`control.max_step`).

    A forward that raises is aborted in the cache (`abort_step`) and retried
    once, at the next step; failing again (or failing once by a plugin's
    fault, `ForwardFailed.retry` False), the sample finishes with
    finish_reason "error" and the next one runs (see engines.recovery).

    Implements the Engine interface (engines.interface). `state()` names the
    sample the cache holds (`generating`) and how many of its tokens are in
    it, so a stopped run can resume it without recomputing them.
    `options.on_token` hears of every sampled token and every sample that fails
    (engines.records.OnToken).

    `options.pipeline`: greedy samples draw their next token on the device and the
    next forward is queued before the host reads it (engines.ahead); tokens,
    cache and state are those of the host path.
    """

    def __init__(self, model, cache, control, options: EngineOptions):
        self.model, self.cache, self.control, self.options = model, cache, control, options
        self.stats = options.stats
        self.pipeline = options.draws_ahead
        self.chunk = min(options.chunk, control.max_step)  # the layout's rule, whoever drives the engine
        self.pacing = drafts.pacing_for(options)  # speculation (engines.drafts): None when off
        self.queue: collections.deque[tuple[Request, Sample]] = collections.deque()  # in order, none started
        self.generating: Generating | None = None
        # Set by restore(): (request, sample, cached) of the sample the restored cache holds; the
        # next _start of that sample continues from it instead of clearing the cache.
        self._resume: tuple[int, int, int] | None = None

    # -- the Engine interface (engines.interface)

    @property
    def has_work(self) -> bool:
        return self.generating is not None or bool(self.queue)

    def add(self, requests: Sequence[Request]) -> None:
        self.queue.extend((r, s) for r in requests for s in r.samples if s.finish_reason is None)

    def step(self) -> bool:
        """One forward of the current sample (its next chunk, or the retry of a failed one),
        starting the next queued sample when none is current."""
        if self.generating is None:
            if not self.queue:
                return False
            self._start(*self.queue.popleft())
        self._forward(self.generating)
        return True

    def run(self, stop: Stop | None = None) -> bool:
        return run_steps(self, stop)

    def cancel(self, request: Request) -> None:
        """End `request`'s unfinished samples ("cancelled"), dropping them from the queue; when
        one is in the cache, the next sample clears it as it starts. Between steps. A token in
        flight is read first: the host path had recorded it (an EOS among them ends its sample
        "stop", which cancel then leaves)."""
        self.settle()
        self.queue = collections.deque((r, s) for r, s in self.queue if r is not request)
        if self.generating is not None and self.generating.request is request:
            self.generating = None
        if self._resume is not None and self._resume[0] == request.index:
            self._resume = None
        for sample in request.samples:
            if sample.finish_reason is None:
                end_sample(request, sample, "cancelled", self.options.on_token, self.options.progress)

    def state(self) -> dict:
        """Which sample the cache holds (request, sample) and how many of its tokens; a token in
        flight is read first (`settle`)."""
        self.settle()
        g = self.generating
        if g is not None:
            return seq_state.save(g.request.index, g.sample.index, g.cached)
        return seq_state.save(*self._resume) if self._resume is not None else seq_state.save()

    def restore(self, state: dict, requests: Sequence[Request]) -> None:
        """The queue becomes the unfinished samples of `requests`; the first of them continues
        from the cache when it is the one `state` names. StateError, naming the field by its
        path in `state` and changing nothing, when `state` is not what `state()` gives for
        them (engines.seq_state.load)."""
        self._resume = seq_state.load(state, requests, self.control.length)
        self.generating = None
        self.queue.clear()
        self.add(requests)

    def settle(self) -> None:
        """Read the token in flight, if any (engines.ahead): the host path's state, between steps."""
        g = self.generating
        if g is not None and g.drawn is not None:
            drawn, g.drawn = g.drawn, None
            self._take(g, drawn.read(0))

    # -- one sample, one forward at a time

    def _start(self, r: Request, s: Sample) -> None:
        if self._resume is not None and self._resume[:2] == (r.index, s.index):
            cached = self._resume[2]  # resuming: the cache holds this sample's first `cached` tokens
        else:
            self.control.clear()
            cached = 0
        self._resume = None
        r.started = True
        self.generating = Generating(r, s, list(r.prompt) + list(s.generated), cached)

    def _realign(self, cached: int) -> None:
        """After a failed forward the cache holds `cached` tokens of the sample.

        abort_step saw to it unless every layer had written the step (the
        failure came later, e.g. in the LM head): that step is complete and
        not aborted, so the length is rewound to `cached` (never below the
        floor: a step ends at most max_write past its start).
        """
        if self.control.length > cached:
            self.control.rewind(cached)

    def _forward(self, g: Generating) -> None:
        r, s, tokens, cached = g.request, g.sample, g.tokens, g.cached
        drawn = g.drawn  # when set, this step feeds that token, not read yet
        if drawn is None and self._draft(g):
            self._forward_draft(g)
            return
        k = 1 if drawn is not None else min(len(tokens) - cached, self.chunk)
        if not self.control.can_extend(k):
            raise CapacityError(f"the seq cache cannot take {k} more token(s) at length {self.control.length}")
        t0 = time.perf_counter()
        positions = range(cached, cached + k)
        done = drawn is not None or cached + k == len(tokens)
        on_device = done and self._draws_ahead(g)
        fed = drawn.tokens if drawn is not None else tokens[cached : cached + k]  # a draw here is of the step's one row
        decode = 1 if (k == 1 and len(tokens) > len(r.prompt)) or drawn is not None else 0
        if on_device:
            def draw(logits):
                return ahead.draw(logits, self.stats, k - decode, decode)
        else:
            draw = HostDraw([(r, s, 0)] if done else [], self.options.sampling).read  # mid-prompt: nothing to draw
        rows, read = scoring(r, cached, k, draw)
        row = self._guarded(g, fed, positions, rows, read)
        if row is None:
            return
        g.cached = cached + k
        finished = False
        if drawn is not None:
            # The step fed a token only now read; when it ends the sample, the step just queued was
            # speculative and its position goes again. The wait for it is its own step's time.
            g.drawn = None
            finished = self._take(g, drawn.read(0))
            t0 += drawn.waited
            if finished:
                self._realign(g.cached - 1)  # as the host path held
        if finished:
            pass  # its next token is nobody's
        elif on_device:
            g.drawn = row  # read by the next step, once its forward is queued
        elif done:
            # a collective when tensor-parallel
            ((token, logprob),) = row.draw()
            (token,) = self.options.agree([token])
            self._take(g, token, logprob)
        seconds = time.perf_counter() - t0
        if self.pacing is not None and drawn is None and not on_device:
            self.pacing.cost.observe(k, seconds)  # a step the host waited for whole, prompt chunks too: timed
        self.stats.account(seconds, k - decode, decode)
        self.stats.note_held(self.control.length, self.control.length, 1)

    def _guarded(self, g: Generating, fed, positions: range, rows: list[int], read: Callable):
        """`read(logits)` of the forward of `fed` at `positions`; None when it failed (aborted, and
        retried at the next step or the sample ended with "error")."""
        r, s, cached = g.request, g.sample, g.cached
        try:
            out = guarded_forward(self.model, self.cache, fed, positions, rows, read)
        except Interrupted:
            self._realign(cached)
            raise
        except ForwardFailed as exc:  # aborted: the cache is back at `cached`
            self._realign(cached)
            self.settle()  # the token it fed came from a forward that succeeded
            self.stats.failed_forwards += 1
            if self.generating is None:
                return None  # that token ended the sample: nothing left to retry
            if not g.retried and exc.retry:  # a plugin's fault is not retried
                g.retried = True  # the next step retries it
                return None
            end_sample(r, s, "error", self.options.on_token, self.options.progress, str(exc))
            self.generating = None
            return None
        g.retried = False
        return out

    # -- drafts (engines.drafts)

    def _may_draft(self, g: Generating) -> bool:
        """Whether `g` is decoding (its last token the one to feed) as a plain sample that may draft."""
        return (self.pacing is not None and g.cached + 1 == len(g.tokens) and len(g.tokens) > len(g.request.prompt)
                and drafts.may_draft(g.request, g.sample, self.options) and self._room(g) > 0)

    def _room(self, g: Generating) -> int:
        """Draft tokens `g`'s next step may carry: the sample's room, within one step and the cache."""
        k = min(drafts.room(g.request, g.sample, self.options.speculate_tokens), self.chunk - 1)
        while k > 0 and not self.control.can_extend(1 + k):
            k -= 1
        return k

    def _draws_ahead(self, g: Generating) -> bool:
        """Whether `g`'s next token is drawn on the device (engines.ahead): not when its next step may
        draft (drafts are looked up on the host)."""
        if not ahead.drawn_on_device(g, g.sample, self.pipeline, self.options.sampling):
            return False
        return not (self.pacing is not None and self.pacing.worth_trying(g.drafting, 1))

    def _draft(self, g: Generating) -> bool:
        """Choose `g`'s draft for its next step (Pacing): whether it has one."""
        if not self._may_draft(g):
            return False
        if not self.pacing.worth_trying(g.drafting, 1):
            self.pacing.choose([(g.drafting, [], 0)], 1, 1)
            return False
        self.pacing.choose([(g.drafting, *g.drafting.index.propose(g.tokens, self._room(g)))], 1, 1)
        return bool(g.drafting.draft)

    def _forward_draft(self, g: Generating) -> None:
        """One step feeding `g`'s last token and its draft, verified there (engines.drafts): the
        rejected positions are rewound, the kept tokens recorded."""
        t0 = time.perf_counter()
        draft, cached = g.drafting.draft, g.cached
        k = 1 + len(draft)
        sampling = g.request.sampling or self.options.sampling

        def read(logits):  # [k, V]
            return np.array(drafts.verify_rows(logits, sampling.temperature == 0.0))

        rows = self._guarded(g, g.tokens[cached:] + draft, range(cached, cached + k), list(range(k)), read)
        if rows is None:
            return
        (kept,) = drafts.agreed(self.options.agree, [drafts.verify(draft, rows, sampling, g.sample.rng)], [k])
        m = len(kept) - 1
        self.pacing.verified(g.drafting, m)
        g.cached = cached + 1 + m
        if m < len(draft) and not self.control.rewind(g.cached):  # the rejected positions leave the cache
            raise CapacityError(f"the seq cache cannot rewind to {g.cached} after rejected drafts")

        def take(token: int) -> bool:
            if not self._take(g, token):
                return False
            self._realign(len(g.tokens))  # it ended before its kept drafts: they leave too
            return True

        recorded = drafts.record_kept(kept, len(draft), self.stats, take)
        seconds = time.perf_counter() - t0
        self.pacing.cost.observe(k, seconds)
        self.stats.account(seconds, 0, 1 + recorded)
        self.stats.note_held(self.control.length, self.control.length, 1)

    def _take(self, g: Generating, token: int, logprob: TokenLogprob | None = None) -> bool:
        """Record `token` (and its `logprob` record) as the sample's next: True when it finished the
        sample (then no longer generating)."""
        r, s = g.request, g.sample
        finished, moved = record_token(s, token, r, self.options.eos, self.stats, logprob)
        self.options.on_token(r, s, token)
        if not finished:
            g.tokens.append(token)
        self.options.progress(moved)
        if finished:
            self.generating = None
        return finished


def scoring(r: Request, cached: int, k: int, draw: Callable) -> tuple[list[int], Callable]:
    """The rows a step of `k` tokens from `cached` reads, and how: its last row through `draw`, after
    the rows of prompt positions it scores (Request.score_prompt; each position's logits score the
    prompt's next token). One row even mid-prompt: evaluating it (or queueing its drawn token)
    forces the step's cache writes."""
    scored = 0 if r.score_prompt is None else min(k, len(r.prompt) - 1 - cached)
    if scored <= 0:
        return [k - 1], draw

    def read(logits):  # [scored + 1, V]: the scored rows, then the step's last
        score_prompt(r, cached, logits[:scored])
        return draw(logits[-1:])

    return [*range(scored), k - 1], read
