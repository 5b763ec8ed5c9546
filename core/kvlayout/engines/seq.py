"""Generation through a seq layout: one sequence at a time (SequenceControl face)."""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Sequence

import attrs

from kvlayout.engines import ahead, seq_state
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
        k = 1 if drawn is not None else min(len(tokens) - cached, self.chunk)
        if not self.control.can_extend(k):
            raise CapacityError(f"the seq cache cannot take {k} more token(s) at length {self.control.length}")
        t0 = time.perf_counter()
        positions = range(cached, cached + k)
        done = drawn is not None or cached + k == len(tokens)
        on_device = done and ahead.drawn_on_device(self.pipeline, self.options.sampling, r, s, drawn is not None)
        fed = ahead.fed([(drawn, 0)]) if drawn is not None else tokens[cached : cached + k]
        decode = 1 if (k == 1 and len(tokens) > len(r.prompt)) or drawn is not None else 0
        on_host = HostDraw([(r, s, 0)] if done else [], self.options.sampling)  # mid-prompt: nothing to draw
        draw = (lambda logits: ahead.draw(logits, self.stats, k - decode, decode)) if on_device else on_host.read
        rows, read = scoring(r, cached, k, draw)
        try:
            row = guarded_forward(self.model, self.cache, fed, positions, rows, read)
        except Interrupted:
            self._realign(cached)
            raise
        except ForwardFailed as exc:  # aborted: the cache is back at `cached`
            self._realign(cached)
            self.settle()  # the token it fed came from a forward that succeeded
            self.stats.failed_forwards += 1
            if self.generating is None:
                return  # that token ended the sample: nothing left to retry
            if not g.retried and exc.retry:  # a plugin's fault is not retried
                g.retried = True  # the next step retries it
                return
            end_sample(r, s, "error", self.options.on_token, self.options.progress, str(exc))
            self.generating = None
            return
        g.retried = False
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
        self.stats.account(time.perf_counter() - t0, k - decode, decode)
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
