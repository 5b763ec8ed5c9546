"""Generation through a cell layout: continuous batching (BatchControl face).

The engine runs the model over the steps its scheduler (engines.scheduler)
declares, draws each sequence's next token, and recovers from a forward that
fails; which sequences a step carries, and what is kept for reuse, is the
scheduler's. The state codec is `engines.cell_state`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import attrs
import mlx.core as mx
import numpy as np

from kvlayout.engines import ahead, cell_state, drafts, shaping
from kvlayout.engines.cell_drafts import CellDrafts
from kvlayout.engines.interface import Stop, run_steps
from kvlayout.engines.options import EngineOptions
from kvlayout.engines.prefixes import PrefixCache
from kvlayout.engines.records import Request, end_sample, record_token
from kvlayout.engines.recovery import guarded_forward
from kvlayout.engines.scheduler import Plan, Running, Scheduler
from kvlayout.engines.shaping import HostDraw, TokenLogprob
from kvlayout.errors import CapacityError, ForwardFailed, KVLayoutError


class CellEngine:
    """Continuous batching over a BatchControl cache.

    Each step is one forward carrying what the scheduler declared: the next
    token of every decoding sequence plus at most `options.chunk` prompt
    tokens (admission, preemption and prefix reuse: engines.scheduler). When
    a prompt is in, its samples fork and share its cells; a finished
    sequence's cells are freed, or kept as a prefix.

    A forward that raises is aborted in the cache (`abort_step`) and each
    sequence it carried is retried once, alone; one that fails again
    finishes with finish_reason "error" and the others carry on. A plugin's
    fault (`ForwardFailed.retry` False) is not retried: every sequence the
    step carried finishes with "error" (see engines.recovery).

    With a `prefixes` cache (engines.prefixes; a server's), prefilled prompts
    and finished samples stay in the table as entries that later sequences
    start from (`Request.cached_tokens`). `state()` does not hold entries: a
    run that saves its state runs without a prefix cache.

    `options.pipeline`: a greedy sequence of one sample draws its next token
    on the device, and the next step's forward is queued before the host
    reads it (engines.ahead). Tokens, the table and `state()` (which reads
    what is in flight first) are the host path's.

    Implements the Engine interface (engines.interface). `options.on_token`
    hears of every sampled token and every sample that fails or is cancelled
    (engines.records.OnToken).
    """

    def __init__(self, model, cache, control, options: EngineOptions, prefixes: PrefixCache | None = None):
        self.model, self.cache, self.bc, self.options = model, cache, control, options
        self.stats, self.prefixes = options.stats, prefixes
        self.pipeline = options.draws_ahead
        self.scheduler = Scheduler(control, options.chunk, options.stats, prefixes, options.max_samples)
        # Whether the cache keeps tables of its own for sliding-window layers (fixed by its config): only
        # then is what they hold asked after each step.
        self.windowed = any(control.cells_by_window())
        # Speculation (engines.cell_drafts): None when off.
        pacing = drafts.pacing_for(options)
        self.drafts = CellDrafts(control, options, pacing) if pacing is not None else None

    # -- the Engine interface (engines.interface)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def add(self, requests: Sequence[Request]) -> None:
        self.scheduler.add(requests)

    def step(self) -> bool:
        """Declare the next step (admitting or preempting as the table allows) and run its forward;
        a failed forward is retried here, each of its sequences alone."""
        if not self.has_work:
            return False
        if self.drafts is not None:
            self.drafts.propose(self.scheduler.plan())  # the running sequences' step, as it will be but for admissions
        plan = self.scheduler.declare(self.settle)
        try:
            self._forward(plan)
        except ForwardFailed as exc:
            # The tokens it fed ahead came from a forward that succeeded: read them, then retry
            # (or fail) whoever they did not finish.
            self.settle()
            plan = [(s, k) for s, k in plan if s in self.scheduler.running]
            if exc.retry:
                self._retry_alone(plan, exc)
            else:  # a plugin's fault: retrying would only meet it again
                self.stats.failed_forwards += 1
                for s, _ in plan:
                    self._fail(s, exc)
        return True

    def run(self, stop: Stop | None = None) -> bool:
        return run_steps(self, stop)

    def cancel(self, request: Request) -> None:
        """End `request`'s unfinished samples ("cancelled"), dropping its queued work and freeing
        its sequences' cells (what an entry or another sequence shares stays); between steps.
        Tokens in flight are read first: the host path had recorded them (an EOS among them ends
        its sample "stop", which cancel then leaves)."""
        self.settle()
        self.scheduler.cancel(request)
        o = self.options
        for sample in request.samples:
            if sample.finish_reason is None:
                end_sample(request, sample, "cancelled", o.on_token, o.progress)

    def state(self) -> dict:
        """The running sequences and the queue (engines.cell_state). KVLayoutError with a prefix
        cache: its entries' ids are in the table and not in the state, so a restored run would
        leak them."""
        if self.prefixes is not None:
            raise KVLayoutError("a CellEngine with a prefix cache has no state to save (its kept prefixes "
                                "are not part of it); build the engine without one to save and resume")
        self.settle()
        return cell_state.save(self.scheduler)

    def restore(self, state: dict, requests: Sequence[Request]) -> None:
        """Take up `state` over `requests` (their samples already restored); StateError, naming
        the field by its path in `state` and changing nothing, when it is not what `state()`
        gives for them (engines.cell_state.load)."""
        cell_state.load(self.scheduler, state, requests)

    def settle(self) -> None:
        """Read every token in flight (engines.ahead), oldest sequence first: the host path's
        state, between steps. A token that ends its sample retires it."""
        for s in [s for s in self.scheduler.running if s.drawn is not None]:
            (drawn, i), s.drawn = s.drawn, None
            self._advance(s, drawn.read(i))

    # -- recovery

    def _retry_alone(self, plan: Plan, exc: ForwardFailed) -> None:
        """The step failed and was aborted: each of its sequences gets one retry, alone."""
        self.stats.failed_forwards += 1
        for s, k in plan:
            # The aborted step's cells are free again, so each part fits.
            if not self.scheduler.declare_plan([(s, k)]):
                raise CapacityError(f"request {s.request.index}: the retry of an aborted step did not fit") from exc
            try:
                self._forward([(s, k)])
            except ForwardFailed as again:
                self.stats.failed_forwards += 1
                self._fail(s, again)

    def _fail(self, s: Running, exc: ForwardFailed) -> None:
        """Finish every sample of `s` with finish_reason "error"; free its cells."""
        self.scheduler.drop(s)
        for sample in s.samples:
            end_sample(s.request, sample, "error", self.options.on_token, self.options.progress, str(exc))

    # -- one forward

    def _forward(self, plan: Plan) -> None:
        t0 = time.perf_counter()
        feed = Feed.of(plan)
        # Who draws on the device: a greedy sequence of one sample whose next token is fed back.
        host, device = [], []
        for i, s in enumerate(feed.completing):
            (device if self._draws_ahead(s, feed.width) else host).append(i)
        # At least one row even when no prompt completes: evaluating it forces the cache writes. The rows
        # of drafts to verify come after the drawing rows, those of prompts being scored (echo with
        # logprobs) last.
        drawing = feed.rows + feed.verify_rows
        row_ids = drawing + feed.scored_rows if feed.scored_rows else (drawing or [feed.width - 1])

        # Every sample of a sequence completing on the host draws from that sequence's row of the host rows.
        hosted = [feed.completing[i] for i in host]
        # None when every token is drawn on the device (a decode step's, usually): nothing is read on the host.
        on_host = HostDraw([(s.request, x, j) for j, s in enumerate(hosted) for x in s.samples],
                           self.options.sampling) if hosted or not device else None
        read = self._reader(feed, device, host, on_host)
        # A failure is aborted in the cache (ForwardFailed) before any counter below moves.
        # Positions as the list of ints they are: the model's one check of them (kvlayout.positions) freezes a
        # decode step's few in one numpy call.
        drawn, rows, checked = guarded_forward(self.model, self.cache, ahead.fed(feed.pieces), feed.positions, row_ids,
                                               read)
        for s, k in plan:
            s.cached += k
        ended, waited = self._read_fed_ahead(feed.fed_ahead)
        t0 += waited  # the step that drew them: its time
        self._note_held(len(plan))  # after the speculative positions of finished samples went, as the host path held
        for j, i in enumerate(device):
            s = feed.completing[i]
            if id(s) not in ended:
                s.drawn = (drawn, j)
                if not s.remembered:  # offered once (Scheduler.remember): every decode step after, nothing to do
                    self.scheduler.remember(s)
        if rows is not None:
            self._complete_on_host(hosted, rows, ended)
        if checked is not None:
            feed.decode += self.drafts.keep(feed.verifying, checked, self._advance)
        seconds = time.perf_counter() - t0
        if self.drafts is not None and not feed.fed_ahead and (rows or checked) is not None:
            # A step the host waited for whole is timed, prompt chunks included: how a wide step costs
            # is known before any draft is tried (on a CPU's 4-bit matmuls, a token its full share).
            self.drafts.pacing.cost.observe(feed.width, seconds)
        self.stats.account(seconds, feed.prefill, feed.decode)

    def _reader(self, feed: Feed, device: list[int], host: list[int], on_host: HostDraw | None):
        """How a step reads its logits `[R, V]`: queue the device draws and the drafts' verification
        rows, then wait for the host's rows and the verification's. (drawn, host rows, verification)."""

        def read(logits):
            if feed.scored_rows:
                logits = feed.score(logits)  # the drawing and verifying rows left
            checked, drawn, rows = [], None, None
            if feed.verifying:
                checked = self.drafts.check(feed.verifying, logits[len(feed.rows) :])
                logits = logits[: len(feed.rows)]
            if not feed.rows and checked:
                pass  # only drafts to verify: reading them forces the step
            elif not device:
                rows = on_host.read(logits)
            else:
                drawn = ahead.draw(logits, self.stats, feed.prefill, feed.decode,
                                   None if len(device) == len(feed.rows) else device)
                rows = on_host.read(logits[mx.array(host, dtype=mx.int32)]) if host else None
            return drawn, rows, [np.array(c) for c in checked] if feed.verifying else None

        return read

    def _read_fed_ahead(self, fed_ahead: list[tuple[Running, tuple[ahead.Drawn, int]]]) -> tuple[set[int], float]:
        """Read the tokens this step fed unread (its own forward is queued behind them). One that
        ends its sample makes this step's position of it speculative: it goes again. (The ids of
        the sequences they ended: their next token is nobody's; the seconds the host waited for the
        steps that drew them, each step once.)"""
        ended, steps, last = set(), [], None
        for s, (d, i) in fed_ahead:
            if d is not last and all(d is not x for x in steps):  # a decode step's tokens: one draw, in a row
                steps.append(d)
            last = d
            s.drawn = None
            if self._advance(s, d.read(i)):
                ended.add(id(s))
        return ended, sum(d.waited for d in steps)

    def _draws_ahead(self, s: Running, fed: int) -> bool:
        """Whether `s`'s next token is drawn on the device (engines.ahead): not when its next step may
        draft (drafts are looked up on the host), in a step like this one, feeding `fed` tokens."""
        if len(s.samples) != 1 or not ahead.drawn_on_device(s, s.samples[0], self.pipeline, self.options.sampling):
            return False
        return self.drafts is None or not self.drafts.may_pay(s, fed)

    def _complete_on_host(self, completing: list[Running], rows: HostDraw, ended: set[int]) -> None:
        """Draw the next token of each sample of `completing` from its row of the step's host `rows`;
        a sequence whose id is in `ended` (a token it fed ahead ended it) advances no further."""
        # Every sample's token is drawn first (its own generator: forking does not change it), agreed
        # once (a collective when tensor-parallel), then each sequence forks, is kept and advances in
        # turn as before: one retiring frees its id before the next one forks.
        # A fork the scheduler cannot clone is queued again and must draw anew then: its generator's
        # state before this draw (only forks: a sequence's first sample always advances).
        before = {id(x): (x, x.rng.bit_generator.state) for s in completing for x in s.samples[1:]}
        drawn = rows.draw()
        agreed = self.options.agree([t for t, _ in drawn])
        token_of = {id(x): (t, lp) for (_, x, _), t, (_, lp) in zip(rows.picks, agreed, drawn)}
        for s in completing:
            if id(s) in ended:
                continue
            forks = self.scheduler.fork(s)
            self.scheduler.remember(s)
            for fork in forks:
                before.pop(id(fork.samples[0]), None)
                self._advance(fork, *token_of[id(fork.samples[0])])
        for sample, state in before.values():  # queued again by fork: it draws anew when it runs
            sample.rng.bit_generator.state = state

    def _advance(self, s: Running, token: int, logprob: TokenLogprob | None = None) -> bool:
        """Record `token` (and its `logprob` record) as `s`'s next; True when that finished it (retired:
        positions a step fed past its tokens leave the cache first)."""
        o = self.options
        finished, done = record_token(s.samples[0], token, s.request, o.eos, self.stats, logprob)
        o.on_token(s.request, s.samples[0], token)
        if finished:
            self.scheduler.finish(s)
        else:
            s.tokens.append(token)
        o.progress(done)
        return finished

    def _note_held(self, batch: int) -> None:
        held = self.bc.capacity - self.bc.free_cells
        windows = max((n for w, n in self.bc.cells_by_window().items() if w), default=0) if self.windowed else 0
        self.stats.note_held(held, sum(s.cached for s in self.scheduler.running), batch, windows)


@attrs.define
class Feed:
    """What one step feeds, read off its plan: per sequence its host ids or the (Drawn, index) of
    a token drawn ahead (`pieces`), every token's position, the rows whose logits give a next
    token (the sequences `completing` there), and the prompt and decode tokens it counts."""

    pieces: list = attrs.field(factory=list)
    positions: list[int] = attrs.field(factory=list)
    rows: list[int] = attrs.field(factory=list)
    completing: list[Running] = attrs.field(factory=list)
    fed_ahead: list[tuple[Running, tuple[ahead.Drawn, int]]] = attrs.field(factory=list)
    prefill: int = 0
    decode: int = 0
    width: int = 0
    # Prompts scored this step (Request.score_prompt): (request, first position, positions), their rows in order.
    scored: list[tuple[Request, int, int]] = attrs.field(factory=list)
    scored_rows: list[int] = attrs.field(factory=list)
    # Sequences feeding their last token and a draft: (sequence, positions), every position a row, in order.
    verifying: list[tuple[Running, int]] = attrs.field(factory=list)
    verify_rows: list[int] = attrs.field(factory=list)

    def score(self, logits: mx.array) -> mx.array:
        """Record the scored prompts' logprobs from their rows, at the end of `logits` `[R, V]`; the rows before."""
        at = len(self.rows) + len(self.verify_rows)
        for request, start, count in self.scored:
            shaping.score_prompt(request, start, logits[at : at + count])
            at += count
        return logits[: len(self.rows) + len(self.verify_rows)]

    @classmethod
    def of(cls, plan: Plan) -> Feed:
        """The Feed of a step's plan: `fed_ahead_only`'s when it reads it (steady decode), else `each`'s."""
        steady = cls.fed_ahead_only(plan)
        return steady if steady is not None else cls.each(plan)

    @classmethod
    def each(cls, plan: Plan) -> Feed:
        """The Feed of any plan, sequence by sequence."""
        f = cls()
        for s, k in plan:
            if s.drafted:  # its last token, then its draft: every position's logits verify the next
                f.pieces.append(s.tokens[s.cached : s.cached + 1] + s.drafting.draft)
                f.positions += range(s.cached, s.cached + k)
                f.verifying.append((s, k))
                f.verify_rows += range(f.width, f.width + k)
                f.width += k
                f.decode += 1  # and what it keeps of the draft, once verified
                continue
            if s.drawn is not None:
                f.pieces.append(s.drawn)
                f.fed_ahead.append((s, s.drawn))
            else:
                f.pieces.append(s.tokens[s.cached : s.cached + k])
            f.positions += range(s.cached, s.cached + k)
            scored = 0 if s.request.score_prompt is None else min(k, len(s.request.prompt) - 1 - s.cached)
            if scored > 0:  # each of these positions' logits scores the prompt's next token
                f.scored.append((s.request, s.cached, scored))
                f.scored_rows += range(f.width, f.width + scored)
            f.width += k
            pending = s.pending
            if k == pending:
                f.rows.append(f.width - 1)
                f.completing.append(s)
            if k == 1 and pending == 1 and (s.drawn is not None or len(s.tokens) > len(s.request.prompt)):
                f.decode += 1
            else:
                f.prefill += k
        return f

    @classmethod
    def fed_ahead_only(cls, plan: Plan) -> Feed | None:
        """The Feed of a step in which every sequence feeds only its token drawn ahead (a steady greedy
        decode step), read off in one pass; None for any other step (`of` reads it then). What `each`
        gives for it: each such sequence holds every token in the cache, so it feeds one token at its
        `cached` position, completes there and counts as decode; none drafts or scores."""
        pieces, positions = [], []
        for s, k in plan:
            drawn = s.drawn
            if drawn is None or k != 1 or len(s.tokens) != s.cached or s.drafted or s.request.score_prompt is not None:
                return None
            pieces.append(drawn)
            positions.append(s.cached)
        seqs = [s for s, _ in plan]
        n = len(seqs)
        return cls(pieces, positions, list(range(n)), seqs, list(zip(seqs, pieces)), decode=n, width=n)
