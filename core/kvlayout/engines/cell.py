"""Generation through a cell layout: continuous batching (BatchControl face).

Token bookkeeping: a running sequence holds `tokens` (its prompt, then what
it generated) of which the first `cached` are in the cache. A step feeds
`tokens[cached:cached + k]`; when that reaches the end, the logits of the last
fed token give the next token. Decoding is the case `pending == 1`.
"""

from __future__ import annotations

import collections
import time
from typing import Sequence

import attrs
import mlx.core as mx
import numpy as np

from kvlayout.engines import ahead
from kvlayout.engines.interface import Stop, run_steps
from kvlayout.engines.prefixes import Hit, PrefixCache, common_length
from kvlayout.engines.records import (
    Agree,
    OnProgress,
    OnToken,
    Request,
    Sample,
    Sampling,
    Stats,
    draw_token,
    end_sample,
    ignore_tokens,
    record_token,
    same_tokens,
)
from kvlayout.engines.recovery import ForwardFailed, guarded_forward, host_logits
from kvlayout.engines import saved
from kvlayout.errors import CapacityError, KVLayoutError


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

    @property
    def pending(self) -> int:
        """Tokens to feed: a token drawn ahead counts, unread as it is."""
        return len(self.tokens) - self.cached + (self.drawn is not None)


@attrs.define(eq=False)
class Waiting:
    """A queued unit of work: a fresh request (all its samples) or a preempted sample."""

    request: Request
    samples: list[Sample]
    tokens: list[int]


WAIT = object()  # _reuse_for: the shared part of a prefill is not all in yet


def reused(hit: Hit | None) -> int:
    return hit.length if hit is not None else 0


class CellEngine:
    """Continuous batching over a BatchControl cache.

    Each step is one forward carrying the next token of every decoding
    sequence plus at most `chunk` prompt tokens, continuing the prefills
    already admitted first and then admitting queued requests while the table
    accepts the declaration (`declare_step` is the admission gate). A prompt is
    prefilled once under one id; when it is in, its samples fork with
    `seq_clone` and share those cells. A finished sequence's cells are freed
    with `seq_rm`. When even the running sequences cannot take the step, the
    most recently admitted one is preempted: its cells are freed and it goes
    back to the front of the queue with the tokens it has, to be recomputed.

    A forward that raises is aborted in the cache (`abort_step`) and each
    sequence it carried is retried once, alone; one that fails again
    finishes with finish_reason "error" and the others carry on. A plugin's
    fault (`ForwardFailed.retry` False) is not retried: every sequence the
    step carried finishes with "error" (see engines.recovery).

    With a `prefixes` cache (engines.prefixes; a server's), a prefilled
    prompt and every finished sample stay in the table as entries, and a
    sequence whose tokens start with an entry's is admitted as a clone of
    it, prefilling only the rest (`Request.cached_tokens`). Entries give way
    first: their ids and cells are evicted, least recently used first,
    before any admission is refused or any sequence preempted. A queued
    request sharing at least a block more with a prompt still prefilling
    than the cache gives is admitted as a clone of that prefill once the
    shared part is in, and waits until then (clients sending one system
    prompt at once: the first prefills it, the rest share its cells).
    `state()` does not hold entries: a run that saves its state runs
    without a prefix cache.

    `pipeline`: a greedy sequence of one sample draws its next token on the
    device, and the next step's forward is queued before the host reads it
    (engines.ahead). Tokens, the table and `state()` (which reads what is in
    flight first) are the host path's.

    Implements the Engine interface (engines.interface): `running`, `queue`
    and the admission counter are what `state()` saves. `on_token` hears of
    every sampled token and every sample that fails or is cancelled
    (engines.records.OnToken).
    """

    def __init__(
        self,
        model,
        cache,
        control,
        eos,
        sampling: Sampling,
        chunk: int,
        stats: Stats,
        progress: OnProgress,
        on_token: OnToken = ignore_tokens,
        prefixes: PrefixCache | None = None,
        agree: Agree = same_tokens,
        pipeline: bool = True,
    ):
        self.model, self.cache, self.bc = model, cache, control
        self.agree = agree
        # Tokens agreed through a collective are read on every step (engines.ahead).
        self.pipeline = pipeline and agree is same_tokens
        self.eos, self.sampling, self.chunk = eos, sampling, chunk
        self.stats, self.progress, self.on_token = stats, progress, on_token
        self.prefixes = prefixes
        self._stale = False  # a verb ran since the last accepted declaration: declare again
        self.running: list[Running] = []
        self.queue: collections.deque[Waiting] = collections.deque()
        self._admissions = 0

    # -- the Engine interface (engines.interface)

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.queue)

    def add(self, requests: Sequence[Request]) -> None:
        max_seqs = self.bc.max_seqs
        for r in requests:
            samples = [s for s in r.samples if s.finish_reason is None]
            # A request with more samples than ids prefills once per group of max_seqs.
            for i in range(0, len(samples), max_seqs):
                self.queue.append(Waiting(r, samples[i : i + max_seqs], list(r.prompt)))

    def step(self) -> bool:
        """Declare the next step (admitting or preempting as the table allows) and run its forward;
        a failed forward is retried here, each of its sequences alone."""
        if not self.has_work:
            return False
        plan = self._declare()
        try:
            self._forward(plan)
        except ForwardFailed as exc:
            # The tokens it fed ahead came from a forward that succeeded: read them, then retry
            # (or fail) whoever they did not finish.
            self.settle()
            plan = [(s, k) for s, k in plan if s in self.running]
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
        self.queue = collections.deque(w for w in self.queue if w.request is not request)
        for s in [s for s in self.running if s.request is request]:
            self.running.remove(s)
            self.bc.seq_rm(s.seq_id)
        for sample in request.samples:
            if sample.finish_reason is None:
                end_sample(request, sample, "cancelled", self.on_token, self.progress)

    def state(self) -> dict:
        """The running sequences (id, request, samples, tokens, admission, cached) and the queue.
        KVLayoutError with a prefix cache: its entries' ids are in the table and not in the state,
        so a restored run would leak them."""
        if self.prefixes is not None:
            raise KVLayoutError("a CellEngine with a prefix cache has no state to save (its kept prefixes "
                                "are not part of it); build the engine without one to save and resume")
        self.settle()
        return {
            "kind": "cell",
            "admissions": self._admissions,
            "running": [
                {
                    "seq_id": s.seq_id,
                    "request": s.request.index,
                    "samples": [x.index for x in s.samples],
                    "tokens": list(s.tokens),
                    "admitted": s.admitted,
                    "cached": s.cached,
                }
                for s in self.running
            ],
            "queue": [
                {"request": w.request.index, "samples": [x.index for x in w.samples], "tokens": list(w.tokens)}
                for w in self.queue
            ],
        }

    def restore(self, state: dict, requests: Sequence[Request]) -> None:
        """Take up `state` over `requests` (their samples already restored). StateError, naming
        the field by its path in `state` and changing nothing, when it is not what `state()`
        gives for them: another engine's, a value of the wrong kind or out of range, a
        sequence's tokens other than its request's prompt and sample's tokens, an unfinished
        sample held nowhere or twice, a running sequence holding another number of positions
        in the cache than it says."""
        if isinstance(state, dict) and state.get("kind", "cell") != "cell":
            raise saved.refuse("kind", f"saved by the {saved.name(state['kind'])} engine, resumed by another")
        state = saved.table(state, "", ("kind", "admissions", "running", "queue"))
        admissions = saved.integer(state["admissions"], "admissions", 0)
        held: dict[tuple[int, int], str] = {}  # (request, sample) -> where the state holds it
        running, ids = [], set()
        for i, d in enumerate(saved.array(state["running"], "running")):
            where = f"running[{i}]"
            d = saved.table(d, where, ("seq_id", "request", "samples", "tokens", "admitted", "cached"))
            r, samples, tokens = self._unit(d, where, requests, held)
            seq_id = saved.integer(d["seq_id"], f"{where}.seq_id", 0)
            if seq_id in ids:
                raise saved.refuse(f"{where}.seq_id", f"sequence {seq_id} is running twice")
            ids.add(seq_id)
            admitted = saved.integer(d["admitted"], f"{where}.admitted", 0, admissions - 1)
            cached = saved.integer(d["cached"], f"{where}.cached", 0, len(tokens) - 1)
            try:
                in_cache = self.bc.next_pos(seq_id)
            except KVLayoutError:
                raise saved.refuse(f"{where}.seq_id", f"the cache holds no sequence {seq_id}") from None
            if in_cache != cached:
                raise saved.refuse(
                    f"{where}.cached", f"sequence {seq_id} holds {in_cache} position(s) in the cache, the run says {cached}"
                )
            running.append(Running(seq_id, r, samples, tokens, admitted, cached))
        waiting = []
        for i, d in enumerate(saved.array(state["queue"], "queue")):
            where = f"queue[{i}]"
            d = saved.table(d, where, ("request", "samples", "tokens"))
            waiting.append(Waiting(*self._unit(d, where, requests, held)))
        for r in requests:
            for s in r.samples:
                if s.finish_reason is None and (r.index, s.index) not in held:
                    raise saved.refuse("queue", f"request {r.index}'s sample {s.index} is unfinished but neither running nor queued")
        self.running, self.queue = running, collections.deque(waiting)
        self._admissions = admissions

    def settle(self) -> None:
        """Read every token in flight (engines.ahead), oldest sequence first: the host path's
        state, between steps. A token that ends its sample retires it."""
        for s in [s for s in self.running if s.drawn is not None]:
            (drawn, i), s.drawn = s.drawn, None
            self._advance(s, drawn.read(i))

    @staticmethod
    def _unit(d: dict, where: str, requests: Sequence[Request], held: dict) -> tuple[Request, list[Sample], list[int]]:
        """A saved sequence's request, samples and tokens, checked; its samples noted in `held`."""
        r = requests[saved.integer(d["request"], f"{where}.request", 0, len(requests) - 1)]
        indices = saved.array(d["samples"], f"{where}.samples", minimum=1)
        samples = []
        for k, j in enumerate(indices):
            path = f"{where}.samples[{k}]"
            s = r.samples[saved.integer(j, path, 0, len(r.samples) - 1)]
            if s.finish_reason is not None:
                raise saved.refuse(path, f"request {r.index}'s sample {j} is finished ({s.finish_reason}); nothing of it runs")
            if (r.index, j) in held:
                raise saved.refuse(path, f"request {r.index}'s sample {j} is also at {held[r.index, j]}")
            held[r.index, j] = where
            samples.append(s)
        # One sample: its prompt and what it generated; several (a prompt being prefilled): the prompt.
        expected = list(r.prompt) + (list(samples[0].generated) if len(samples) == 1 else [])
        if len(samples) > 1 and any(s.generated for s in samples):
            raise saved.refuse(f"{where}.samples", "a prompt still prefilling for several samples, one of which generated")
        if d["tokens"] != expected or any(type(t) is not int for t in d["tokens"]):
            raise saved.refuse(f"{where}.tokens", f"not request {r.index}'s prompt and its sample's tokens so far")
        return r, samples, expected

    # -- recovery

    def _retry_alone(self, plan: list[tuple[Running, int]], exc: ForwardFailed) -> None:
        """The step failed and was aborted: each of its sequences gets one retry, alone."""
        self.stats.failed_forwards += 1
        for s, k in plan:
            # The aborted step's cells are free again, so each part fits.
            if not self.bc.declare_step([s.seq_id] * k):
                raise CapacityError(f"request {s.request.index}: the retry of an aborted step did not fit") from exc
            try:
                self._forward([(s, k)])
            except ForwardFailed as again:
                self.stats.failed_forwards += 1
                self._fail(s, again)

    def _fail(self, s: Running, exc: ForwardFailed) -> None:
        """Finish every sample of `s` with finish_reason "error"; free its cells."""
        self.running.remove(s)
        self.bc.seq_rm(s.seq_id)
        for sample in s.samples:
            end_sample(s.request, sample, "error", self.on_token, self.progress, str(exc))

    # -- planning

    def _ids_held(self) -> int:
        """Sequence ids in use, counting the forks a prefilling prompt will need."""
        return sum(len(s.samples) for s in self.running)

    def _plan(self) -> list[tuple[Running, int]]:
        """(sequence, tokens this step) for the running sequences, oldest first."""
        budget = self.chunk
        plan = []
        for s in self.running:
            if s.pending == 1:
                plan.append((s, 1))
            elif budget > 0:
                k = min(s.pending, budget)
                budget -= k
                plan.append((s, k))
        return plan

    def _budget_left(self, plan: list[tuple[Running, int]]) -> int:
        return self.chunk - sum(k for s, k in plan if s.pending > 1)

    def _try(self, plan: list[tuple[Running, int]]) -> bool:
        # The step's id per token as one array: a layout checks an array without a Python loop.
        accepted = self.bc.declare_step(np.repeat([s.seq_id for s, _ in plan], [k for _, k in plan]))
        if accepted:
            self._stale = False
        return accepted

    def _declare(self) -> list[tuple[Running, int]]:
        """Declare the next step, preempting or admitting as the table allows."""
        preempted = False
        self._stale = True  # nothing declared yet
        plan = self._plan()
        while plan and not self._try(plan):
            if any(s.drawn is not None for s in self.running):
                self.settle()  # a token in flight may end its sample and free its cells, as on the host path
                plan = self._plan()
                continue
            if self._evict():
                continue  # a kept prefix gives way before any live sequence
            if len(self.running) == 1:
                # check_capacity makes this unreachable: a lone sequence always fits.
                s = self.running[0]
                raise CapacityError(
                    f"request {s.request.index} alone cannot take its next step "
                    f"({self.bc.free_cells} free cells of {self.bc.capacity})"
                )
            self._preempt_latest()
            preempted = True
            plan = self._plan()
        if preempted:
            # Admitting now would only readmit what was just preempted.
            return plan
        while self.queue:
            w = self.queue[0]
            hit = self._reuse_for(w.tokens)
            if hit is WAIT:
                break  # what it shares with a prefill is not all in yet: wait rather than prefill it again
            # Nothing is evicted before the budget check: a request that waits must not empty the cache.
            if len(w.tokens) - reused(hit) > 1 and self._budget_left(plan) == 0:
                break  # this step's prompt budget is spent
            if hit is not None and not self._room_for_ids(len(w.samples), hit):
                hit = None  # what it found must give way for ids too
                if len(w.tokens) > 1 and self._budget_left(plan) == 0:
                    break
            if not self._room_for_ids(len(w.samples), None):
                break
            self._stale = True  # a verb after the declaration ends it (see BatchControl)
            sid = self.bc.seq_new() if hit is None else self.bc.seq_clone(hit.seq_id, hit.length)
            if sid is None:
                break
            cached = reused(hit)
            s = Running(sid, w.request, w.samples, list(w.tokens), self._admissions, cached)
            self.running.append(s)
            if self._admit(s):
                self.queue.popleft()
                self._admissions += 1
                plan = self._plan()
                if self.prefixes is not None:
                    self.prefixes.note_admitted(hit)
                r = w.request
                if hit is not None and hit.source != r.index:  # its own prompt, found again, was not reuse
                    r.cached_tokens = max(r.cached_tokens, min(cached, len(r.prompt)))
                continue
            # Not this step: no prompt budget left, or not enough free cells.
            self.running.pop()
            self.bc.seq_rm(sid)  # an empty id is released by seq_rm
            break
        if self._stale and plan and not self._try(plan):
            # A verb ran since the last accepted declaration; re-declaring what
            # was accepted cannot fail for cells, but never run undeclared.
            raise CapacityError("the cell table refused a declaration it had just accepted")
        if not plan:
            raise CapacityError(
                f"nothing can run: {len(self.queue)} queued, {self.bc.free_cells} free cells of "
                f"{self.bc.capacity}, {self._ids_held()} of {self.bc.max_seqs} ids held"
            )
        return plan

    def _admit(self, s: Running) -> bool:
        """Whether the step can take the just-added `s` too (declared if so), evicting kept
        prefixes for cells while that helps."""
        while True:
            trial = self._plan()
            if not (trial and trial[-1][0] is s):
                return False  # no prompt budget left for it
            if self._try(trial):
                return True
            if not self._evict():
                return False

    # -- the prefix cache (engines.prefixes)

    def _reuse_for(self, tokens: list[int]) -> Hit | None | object:
        """The cells a sequence of `tokens` may start from: a kept prefix, or a prompt still
        prefilling that shares at least a block more (as far as it is in; WAIT while that is not
        all of what it shares); None for nothing."""
        if self.prefixes is None or len(tokens) < 2:
            return None
        hit = self.prefixes.find(tokens, len(tokens) - 1)  # at least one token is fed: its logits
        sharing = self._sharing_prefill(tokens, reused(hit))
        if sharing is None:
            return hit
        s, common = sharing
        return WAIT if s.cached < common else Hit(s.seq_id, common, s.request.index)

    def _sharing_prefill(self, tokens: list[int], cached: int) -> tuple[Running, int] | None:
        """(a prompt still prefilling, how many of `tokens` it shares) when it shares at least a
        block more than the prefix cache gave; the one sharing most. Clients sending one system
        prompt at once: the first prefills it, the others clone it as far as it is in, or wait."""
        if self.prefixes is None:
            return None
        best, most = None, cached + self.prefixes.block - 1
        for s in self.running:
            if s.remembered:
                continue
            common = common_length(s.tokens, tokens, len(tokens) - 1)
            if common > most:
                best, most = s, common
        return None if best is None else (best, most)

    def _evict(self, spare: Hit | None = None) -> bool:
        """Drop the least recently used kept prefix (not `spare`'s): whether there was one."""
        if self.prefixes is None or not self.prefixes.evict(None if spare is None else spare.seq_id):
            return False
        self._stale = True
        return True

    def _room_for_ids(self, k: int, spare: Hit | None) -> bool:
        """Whether `k` more ids fit beside the running ones, evicting kept prefixes (never the
        one `spare` is on) until they do."""
        kept = len(self.prefixes) if self.prefixes is not None else 0
        while self._ids_held() + kept + k > self.bc.max_seqs:
            if not self._evict(spare):
                return False
            kept = len(self.prefixes)
        return True

    def _remember(self, s: Running) -> None:
        """Offer `s`'s tokens in the cache (its prompt, just prefilled) to the prefix cache, under
        an id cloned from it, when an id is to be had by evicting kept prefixes at most."""
        s.remembered = True
        tokens = s.tokens[: s.cached]
        p = self.prefixes
        if p is None or len(tokens) < p.block:
            return
        keys = p.chain(tokens, len(tokens) // p.block)  # once, for both questions below
        if p.covers(tokens, keys) or not self._room_for_ids(1, None):
            return
        sid = self.bc.seq_clone(s.seq_id, s.cached)
        if sid is not None:
            p.keep(sid, tokens, s.request.index, keys)

    def _retire(self, s: Running) -> None:
        """`s` finished: its id becomes a kept prefix, or is released (its cells no other sample
        shares are freed)."""
        if self.prefixes is not None:
            self.prefixes.keep(s.seq_id, s.tokens[: s.cached], s.request.index)
        else:
            self.bc.seq_rm(s.seq_id)

    def _preempt_latest(self) -> None:
        # Forks of one prompt share its admission number; the last of them goes first.
        victim = max(reversed(self.running), key=lambda s: s.admitted)
        self.running.remove(victim)
        self.bc.seq_rm(victim.seq_id)
        # A prefilling prompt keeps all its samples; a fork keeps what it generated.
        self.queue.appendleft(Waiting(victim.request, victim.samples, victim.tokens))
        self.stats.preemptions += 1

    # -- one forward

    def _forward(self, plan: list[tuple[Running, int]]) -> None:
        t0 = time.perf_counter()
        pieces: list = []  # per sequence: its host ids, or (Drawn, index) of a token drawn ahead
        positions: list[int] = []
        rows: list[int] = []
        completing: list[Running] = []
        fed_ahead: list[tuple[Running, tuple[ahead.Drawn, int]]] = []
        prefill = decode = width = 0
        for s, k in plan:
            if s.drawn is not None:
                pieces.append(s.drawn)
                fed_ahead.append((s, s.drawn))
            else:
                pieces.append(s.tokens[s.cached : s.cached + k])
            positions += range(s.cached, s.cached + k)
            width += k
            if k == s.pending:
                rows.append(width - 1)
                completing.append(s)
            if k == 1 and s.pending == 1 and (s.drawn is not None or len(s.tokens) > len(s.request.prompt)):
                decode += 1
            else:
                prefill += k
        # Who draws on the device: a greedy sequence of one sample whose next token is fed back.
        on_device = [self._draws_ahead(s) for s in completing]
        host = [i for i, d in enumerate(on_device) if not d]
        device = [i for i, d in enumerate(on_device) if d]
        # At least one row even when no prompt completes: evaluating it forces the cache writes.
        row_ids = rows or [width - 1]

        def read(logits):  # [R, V]: queue the device draws, then wait for the host's rows (if any)
            if not device:
                return None, host_logits(logits)
            drawn = ahead.draw(logits, self.stats, prefill, decode, None if len(device) == len(row_ids) else device)
            return drawn, host_logits(logits[mx.array(host, dtype=mx.int32)]) if host else None

        # A failure is aborted in the cache (ForwardFailed) before any counter below moves.
        drawn, logits = guarded_forward(self.model, self.cache, ahead.fed(pieces), positions, row_ids, read)
        for s, k in plan:
            s.cached += k
        # The tokens this step fed unread are read now, its own forward queued behind them. One
        # that ends its sample makes this step's position of it speculative: it goes again.
        ended = set()  # ids of the sequences a token they fed ahead ended: their next token is nobody's
        for s, (d, i) in fed_ahead:
            s.drawn = None
            if self._advance(s, d.read(i), speculative=True):
                ended.add(id(s))
        t0 += sum({id(d): d.waited for _, (d, _) in fed_ahead}.values())  # the step that drew them: its time
        self._note_held(len(plan))  # after the speculative positions of finished samples went, as the host path held
        for j, i in enumerate(device):
            s = completing[i]
            if id(s) not in ended:
                s.drawn = (drawn, j)
                if not s.remembered:
                    self._remember(s)
        if logits is not None:
            self._complete_on_host([completing[i] for i in host], logits, ended)
        self.stats.account(time.perf_counter() - t0, prefill, decode)

    def _draws_ahead(self, s: Running) -> bool:
        """Whether `s`'s next token is drawn on the device (engines.ahead)."""
        return len(s.samples) == 1 and ahead.drawn_on_device(
            self.pipeline, self.sampling, s.request, s.samples[0], s.drawn is not None
        )

    def _complete_on_host(self, completing: list[Running], logits, ended: set[int]) -> None:
        """Draw the next token of each sample of `completing` from its row of `logits` `[R, V]`;
        a sequence whose id is in `ended` (a token it fed ahead ended it) advances no further."""
        # Every sample's token is drawn first (its own generator: forking does not change it), agreed
        # once (a collective when tensor-parallel), then each sequence forks, is kept and advances in
        # turn as before: one retiring frees its id before the next one forks.
        samples = [(s.request, sample, row) for s, row in zip(completing, logits) for sample in s.samples]
        # A fork _fork cannot clone is queued again and must draw anew then: its generator's state
        # before this draw (only forks: a sequence's first sample always advances).
        before = {id(x): (x, x.rng.bit_generator.state) for s in completing for x in s.samples[1:]}
        drawn = [draw_token(sample, row, request, self.sampling) for request, sample, row in samples]
        token_of = {id(x): t for (_, x, _), t in zip(samples, self.agree(drawn))}
        for s in completing:
            if id(s) in ended:
                continue
            forks = self._fork(s)
            if not s.remembered:
                self._remember(s)
            for fork in forks:
                before.pop(id(fork.samples[0]), None)
                self._advance(fork, token_of[id(fork.samples[0])])
        for sample, state in before.values():  # queued again by _fork: it draws anew when it runs
            sample.rng.bit_generator.state = state

    def _fork(self, s: Running) -> list[Running]:
        """A prefilled prompt becomes one sequence per sample, sharing its cells."""
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

    def _advance(self, s: Running, token: int, speculative: bool = False) -> bool:
        """Record `token` as `s`'s next; True when that finished it (retired). `speculative`: the
        step just queued fed `token` already, so on finishing its position is removed first."""
        finished, done = record_token(s.samples[0], token, s.request, self.eos, self.stats)
        self.on_token(s.request, s.samples[0], token)
        if finished:
            self.running.remove(s)
            if speculative:
                s.cached -= 1
                if self.prefixes is not None:  # kept as an entry: only what its tokens say
                    self.bc.seq_rm(s.seq_id, s.cached)
            self._retire(s)
        else:
            s.tokens.append(token)
        self.progress(done)
        return finished

    def _note_held(self, batch: int) -> None:
        held = self.bc.capacity - self.bc.free_cells
        self.stats.note_held(held, sum(s.cached for s in self.running), batch)
