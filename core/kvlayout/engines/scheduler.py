"""Which sequences run the next cell step: admission, preemption and prefix reuse.

The scheduler holds the running sequences and the queue, and speaks to the
cache only through its BatchControl face (ids and cells, never K/V): it
decides what the next step carries and declares it (`declare_step` is the
admission gate), and it keeps, finds and evicts prefixes. It never runs the
model; `engines.cell` does, over the plan this module hands it.

Token bookkeeping: a running sequence holds `tokens` (its prompt, then what
it generated) of which the first `cached` are in the cache. A step feeds
`tokens[cached:cached + k]`; when that reaches the end, the logits of the last
fed token give the next token. Decoding is the case `pending == 1`.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Sequence

import attrs
import numpy as np

from kvlayout.engines import ahead, drafts
from kvlayout.engines.prefixes import Hit, PrefixCache, common_length
from kvlayout.engines.records import Request, Sample, Stats
from kvlayout.errors import CapacityError
from kvlayout.faces import BatchControl


@attrs.define(eq=False)
class Running:
    """A live sequence of the cell table.

    `samples` holds one sample, or, while a request's prompt is being
    prefilled, every sample that will fork from it once the prompt is in.
    """

    seq_id: int
    request: Request
    samples: list[Sample]
    tokens: list[int]
    admitted: int  # admission counter: the latest admitted is preempted first
    cached: int = 0
    remembered: bool = False  # its prompt was offered to the prefix cache (once, when it was in)
    # Its next token, drawn on the device and not read yet (engines.ahead): (the step's tokens,
    # its index there). While set, all of `tokens` are in the cache and the next step feeds it.
    drawn: tuple[ahead.Drawn, int] | None = None
    # Its drafting (engines.drafts), made when it first may draft: the draft tokens the next step
    # feeds after its last one, to be verified there.
    drafting: drafts.DraftState | None = None
    # Whether its one sample is greedy and plain, the engine pipelining (engines.ahead.drawn_on_device): its
    # settings, asked once (None: not yet).
    plain: bool | None = None

    @property
    def pending(self) -> int:
        """Tokens to feed: a token drawn ahead counts, unread as it is."""
        return len(self.tokens) - self.cached + (self.drawn is not None)

    @property
    def drafted(self) -> int:
        """Draft tokens the next step feeds after its last token."""
        return len(self.drafting.draft) if self.drafting is not None else 0


@attrs.define(eq=False)
class Waiting:
    """A queued unit of work: a fresh request (all its samples) or a preempted sample."""

    request: Request
    samples: list[Sample]
    tokens: list[int]


Plan = list[tuple[Running, int]]  # (sequence, tokens it feeds this step), oldest first

WAIT = object()  # reuse_for: the shared part of a prefill is not all in yet


def reused(hit: Hit | None) -> int:
    return hit.length if hit is not None else 0


def within_cap(held: int, k: int, cap: int | None) -> bool:
    """Whether `k` more samples beside `held` keep within `cap` (None: no cap; a lone unit always runs)."""
    return cap is None or held == 0 or held + k <= cap


def drop_drafts(running: list[Running]) -> bool:
    """Clear every one of `running`'s drafts: whether there was one."""
    dropped = False
    for s in running:
        if s.drafted:
            s.drafting.draft = []
            dropped = True
    return dropped


def budget_left(plan: Plan, chunk: int) -> int:
    """Prompt tokens `plan` leaves of a step's `chunk`."""
    return chunk - sum(k for s, k in plan if s.pending > 1)


class Scheduler:
    """The running sequences and the queue of one BatchControl cache.

    Each step carries the next token of every decoding sequence plus at most
    `chunk` prompt tokens, continuing the prefills already admitted first and
    then admitting queued requests while the table accepts the declaration. A
    prompt is prefilled once under one id; when it is in, its samples `fork`
    with `seq_clone` and share those cells. When even the running sequences
    cannot take the step, the most recently admitted one is preempted: its
    cells are freed and it goes back to the front of the queue with the tokens
    it has, to be recomputed.

    With a `prefixes` cache (engines.prefixes), a prefilled prompt and every
    finished sample stay in the table as entries, and a sequence whose tokens
    start with an entry's is admitted as a clone of it, prefilling only the
    rest. Entries give way first: least recently used first, before any
    admission is refused or any sequence preempted. A queued request sharing
    at least a block more with a prompt still prefilling than the cache gives
    is admitted as a clone of that prefill once the shared part is in, and
    waits until then.

    `max_samples` (a server's `max_sequences`) caps the samples generating at
    once: the head of the queue waits while admitting it would pass the cap
    (and every request behind it: first come, first served).
    """

    def __init__(self, control: BatchControl, chunk: int, stats: Stats, prefixes: PrefixCache | None = None,
                 max_samples: int | None = None):
        self.bc, self.chunk, self.stats, self.prefixes = control, chunk, stats, prefixes
        self.max_samples = max_samples  # None: as many as the ids allow
        self.running: list[Running] = []
        self.queue: collections.deque[Waiting] = collections.deque()
        self.admissions = 0
        self._stale = False  # a verb ran since the last accepted declaration: declare again
        # Layer groups with sliding windows (BatchControl.cells_by_window) keep a sequence's last window
        # only, unless it is pinned: a prompt is, until the prefix cache has kept it (so later requests
        # can part from it anywhere, as on a model without windows).
        self.pins = prefixes is not None and any(w > 0 for w in control.cells_by_window())

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.queue)

    def add(self, requests: Sequence[Request]) -> None:
        """Queue the unfinished samples of `requests`; one with more samples than ids prefills once
        per group of max_seqs."""
        max_seqs = self.bc.max_seqs
        for r in requests:
            samples = [s for s in r.samples if s.finish_reason is None]
            for i in range(0, len(samples), max_seqs):
                self.queue.append(Waiting(r, samples[i : i + max_seqs], list(r.prompt)))

    # -- the next step

    def declare(self, settle: Callable[[], None]) -> Plan:
        """Declare the next step, preempting or admitting as the table allows: its plan.
        `settle()` reads the tokens in flight (one may end its sample and free its cells, as on
        the host path). CapacityError when nothing can run."""
        self._stale = True  # nothing declared yet
        plan, preempted = self._make_room(settle)
        if not preempted:  # admitting after a preemption would only readmit what was just preempted
            plan = self._admit_queued(plan)
        if self._stale and plan and not self.declare_plan(plan):
            # A verb ran since the last accepted declaration; re-declaring what
            # was accepted cannot fail for cells, but never run undeclared.
            raise CapacityError("the cell table refused a declaration it had just accepted")
        if not plan:
            raise CapacityError(
                f"nothing can run: {len(self.queue)} queued, {self.bc.free_cells} free cells of "
                f"{self.bc.capacity}, {self.ids_held()} of {self.bc.max_seqs} ids held"
            )
        return plan

    def _make_room(self, settle: Callable[[], None]) -> tuple[Plan, bool]:
        """The running sequences' plan once the table takes it: tokens in flight read, kept
        prefixes evicted, then the latest admitted preempted, as each is needed. (plan, whether
        a sequence was preempted)."""
        preempted = False
        plan = self.plan()
        while plan and not self.declare_plan(plan):
            if drop_drafts(self.running):  # drafts are the first to give way: they only may pay
                plan = self.plan()
                continue
            if any(s.drawn is not None for s in self.running):
                settle()
                plan = self.plan()
                continue
            if self.evict():
                continue  # a kept prefix gives way before any live sequence
            if len(self.running) == 1:
                # check_capacity makes this unreachable: a lone sequence always fits.
                s = self.running[0]
                raise CapacityError(
                    f"request {s.request.index} alone cannot take its next step "
                    f"({self.bc.free_cells} free cells of {self.bc.capacity})"
                )
            self.preempt_latest()
            preempted = True
            plan = self.plan()
        return plan, preempted

    def _admit_queued(self, plan: Plan) -> Plan:
        """Admit queued work, oldest first, while the cap, the prompt budget, the ids and the cells allow;
        the plan with it (declared, unless the last verb ran after the last declaration)."""
        while self.queue:
            w = self.queue[0]
            if not within_cap(self.ids_held(), len(w.samples), self.max_samples):
                break  # checked first: a request that waits evicts nothing
            # A prompt to score is prefilled whole: cells reused from elsewhere would give no logits.
            # A stored prefix is loaded only into cells the step's declared plan leaves free.
            room = self.bc.free_cells - sum(k - s.drafted for s, k in plan)  # drafts give way to it
            hit = None if w.request.score_prompt is not None else self.reuse_for(w.tokens, w.request.isolation, room)
            if hit is WAIT:
                break  # what it shares with a prefill is not all in yet: wait rather than prefill it again
            # Nothing is evicted before the budget check: a request that waits must not empty the cache.
            if len(w.tokens) - reused(hit) > 1 and budget_left(plan, self.chunk) == 0:
                break  # this step's prompt budget is spent
            if hit is not None and not self.room_for_ids(len(w.samples), hit):
                hit = None  # what it found must give way for ids too
                if len(w.tokens) > 1 and budget_left(plan, self.chunk) == 0:
                    break
            if not self.room_for_ids(len(w.samples), None):
                break
            admitted = self._admit(w, hit)
            if admitted is None:
                return self.plan()  # as it was, but for drafts the trial may have dropped
            plan = admitted
        return plan

    def _admit(self, w: Waiting, hit: Hit | None) -> Plan | None:
        """Take the head of the queue `w` into the step (from `hit`'s cells when set): the new
        plan, or None (nothing changed) when it does not fit this step."""
        self._stale = True  # a verb after the declaration ends it (see BatchControl)
        sid = self.bc.seq_new() if hit is None else self.bc.seq_clone(hit.seq_id, hit.length)
        if sid is None:
            return None
        cached = reused(hit)
        s = Running(sid, w.request, w.samples, list(w.tokens), self.admissions, cached)
        if self.pins:
            self.bc.seq_pin(sid)  # its prompt stays whole in the window layers until it is kept
        self.running.append(s)
        if not self._step_takes(s):
            self.running.pop()
            self.bc.seq_rm(sid)  # an empty id is released by seq_rm
            return None
        self.queue.popleft()
        self.admissions += 1
        w.request.started = True
        if self.prefixes is not None:
            self.prefixes.note_admitted(hit)
        r = w.request
        if hit is not None and hit.source != r.index:  # its own prompt, found again, was not reuse
            r.cached_tokens = max(r.cached_tokens, min(cached, len(r.prompt)))
        return self.plan()

    def _step_takes(self, s: Running) -> bool:
        """Whether the step can take the just-added `s` too (declared if so), evicting kept
        prefixes for cells while that helps."""
        while True:
            trial = self.plan()
            if not (trial and trial[-1][0] is s):
                return False  # no prompt budget left for it
            if self.declare_plan(trial):
                return True
            if drop_drafts(self.running):  # the running sequences' drafts give way to an admission
                continue
            if not self.evict():
                return False  # not enough free cells

    def plan(self) -> Plan:
        """(sequence, tokens this step) for the running sequences, oldest first: every decoding
        sequence, and prompts as far as `chunk` tokens go."""
        budget = self.chunk
        plan = []
        for s in self.running:
            # `pending` and `drafted` read in line: every running sequence is asked every step.
            pending = len(s.tokens) - s.cached + (s.drawn is not None)
            if pending == 1:
                plan.append((s, 1 if s.drafting is None else 1 + len(s.drafting.draft)))
            elif budget > 0:
                k = min(pending, budget)
                budget -= k
                plan.append((s, k))
        return plan

    def declare_plan(self, plan: Plan) -> bool:
        """Declare `plan` to the table: whether it took it (nothing changed when not)."""
        # The step's id per token: a decode step's as the list of ints it is (a layout freezes a few in one
        # numpy call), any other as one array (checked without a Python loop).
        ids = [s.seq_id for s, _ in plan]
        counts = [k for _, k in plan]
        one_each = counts.count(1) == len(counts)  # a decode step: nothing to repeat
        accepted = self.bc.declare_step(ids if one_each else np.repeat(ids, counts))
        if accepted:
            self._stale = False
        return accepted

    def ids_held(self) -> int:
        """Sequence ids in use, counting the forks a prefilling prompt will need."""
        return sum(len(s.samples) for s in self.running)

    # -- sequences leaving

    def preempt_latest(self) -> None:
        """Free the most recently admitted sequence's cells and queue it first again."""
        # Forks of one prompt share its admission number; the last of them goes first.
        victim = max(reversed(self.running), key=lambda s: s.admitted)
        self.running.remove(victim)
        self.bc.seq_rm(victim.seq_id)
        # A prefilling prompt keeps all its samples; a fork keeps what it generated.
        self.queue.appendleft(Waiting(victim.request, victim.samples, victim.tokens))
        self.stats.preemptions += 1

    def cancel(self, request: Request) -> None:
        """Drop `request`'s queued work and its sequences (what an entry or another sequence
        shares of their cells stays)."""
        self.queue = collections.deque(w for w in self.queue if w.request is not request)
        for s in [s for s in self.running if s.request is request]:
            self.drop(s)

    def drop(self, s: Running) -> None:
        """`s` runs no more and holds nothing (a failed sequence, a cancelled one)."""
        self.running.remove(s)
        self.bc.seq_rm(s.seq_id)

    def finish(self, s: Running) -> None:
        """`s`'s sample ended: its id becomes a kept prefix, or is released (cells no other
        sample shares are freed). Positions the cache holds past its tokens go first: a step fed
        them before the token that ended it was read (one drawn ahead, kept drafts after it)."""
        self.running.remove(s)
        if s.cached > len(s.tokens):
            s.cached = len(s.tokens)
            if self.prefixes is not None:  # kept as an entry: only what its tokens say
                self.bc.seq_rm(s.seq_id, s.cached)
        if self.prefixes is not None:
            self.prefixes.keep(s.seq_id, s.tokens[: s.cached], s.request.index, isolation=s.request.isolation)
        else:
            self.bc.seq_rm(s.seq_id)

    def fork(self, s: Running) -> list[Running]:
        """A prefilled prompt becomes one sequence per sample, sharing its cells: the sequences
        that go on now (a sample the layout has no id for is queued again, to be recomputed)."""
        if len(s.samples) == 1:
            return [s]
        forks = [s]
        rest, s.samples = s.samples[1:], s.samples[:1]
        at = self.running.index(s) + 1
        for sample in rest:
            sid = self.bc.seq_clone(s.seq_id)
            if sid is None:  # ids were reserved at admission, so only a layout's own limit gets here
                self.queue.appendleft(Waiting(s.request, [sample], list(s.request.prompt)))
                continue
            f = Running(sid, s.request, [sample], list(s.tokens), s.admitted, s.cached, remembered=True)
            self.running.insert(at, f)
            at += 1
            forks.append(f)
        return forks

    # -- the prefix cache (engines.prefixes)

    def reuse_for(self, tokens: list[int], isolation: str = "", room: int | None = None) -> Hit | None | object:
        """The cells a sequence of `tokens` may start from: a kept prefix, or a prompt still
        prefilling that shares at least a block more (as far as it is in; WAIT while that is not
        all of what it shares); None for nothing. Clients sending one system prompt at once: the
        first prefills it, the others clone it as far as it is in, or wait. Only sequences of
        the same `isolation` key (Request.isolation) lend their cells. A prefix kept on disk
        (engines.prefix_store) is loaded into at most `room` free cells (PrefixCache.find)."""
        if self.prefixes is None or len(tokens) < 2:
            return None
        loaded = self.prefixes.loaded
        hit = self.prefixes.find(tokens, len(tokens) - 1, isolation, room)  # at least one token is fed: its logits
        if self.prefixes.loaded != loaded:
            self._stale = True  # a stored prefix was placed in the cells: a verb after the declaration
        # The prompt still prefilling that shares most, when that is at least a block more.
        best, most = None, reused(hit) + self.prefixes.block - 1
        for s in self.running:
            if s.remembered or s.request.isolation != isolation:
                continue
            common = common_length(s.tokens, tokens, len(tokens) - 1)
            if common > most:
                best, most = s, common
        if best is None:
            return hit
        if best.cached < most:
            return WAIT
        if most < self.bc.seq_floor(best.seq_id):
            return hit  # not pinned (no prefix cache): its sliding layers no longer hold the window there
        return Hit(best.seq_id, most, best.request.index)

    def evict(self, spare: Hit | None = None) -> bool:
        """Drop the least recently used kept prefix (not `spare`'s): whether there was one."""
        if self.prefixes is None or not self.prefixes.evict(None if spare is None else spare.seq_id):
            return False
        self._stale = True
        return True

    def room_for_ids(self, k: int, spare: Hit | None) -> bool:
        """Whether `k` more ids fit beside the running ones, evicting kept prefixes (never the
        one `spare` is on) until they do."""
        kept = len(self.prefixes) if self.prefixes is not None else 0
        while self.ids_held() + kept + k > self.bc.max_seqs:
            if not self.evict(spare):
                return False
            kept = len(self.prefixes)
        return True

    def remember(self, s: Running) -> None:
        """Offer `s`'s tokens in the cache (its prompt, just prefilled) to the prefix cache, under
        an id cloned from it, when no entry covers them and an id is to be had by evicting kept
        prefixes at most. Once. On a windowed cache `s` stays pinned (whole) until an entry holds
        its prompt, and the entry kept is pinned."""
        if s.remembered:
            return
        s.remembered = True
        tokens = s.tokens[: s.cached]
        p = self.prefixes
        if p is None or len(tokens) < p.block:
            if self.pins:
                self.bc.seq_pin(s.seq_id, False)  # too short to keep: nothing to stay whole for
            return
        isolation = s.request.isolation
        keys = p.chain(tokens, len(tokens) // p.block, isolation)  # once, for both questions below
        if not p.covers(tokens, keys, isolation):
            sid = self.bc.seq_clone(s.seq_id, s.cached) if self.room_for_ids(1, None) else None
            if sid is None or not p.keep(sid, tokens, s.request.index, keys, isolation):
                return  # no id for an entry: it stays whole (pinned), so its own entry can lend its prompt
            if self.pins:
                self.bc.seq_pin(sid)  # kept whole: a later prompt may part from it anywhere
        if self.pins:
            self.bc.seq_pin(s.seq_id, False)  # it goes on decoding: its window layers keep its last window
