"""The engine thread: one engine, one model, stepped continuously; requests come and go between steps.

The HTTP side never touches the engine. It hands a `Ticket` to `submit`
(which answers at once: accepted, or `QueueFull`) and may `cancel` it; the
engine thread takes both up between two steps, so a request joins the
running batch at the next step and a cancelled one's cells are freed before
the step after its cancellation. What the engine generates comes back as
`Event`s, posted to the ticket's asyncio queue on the server's event loop
(`loop.call_soon_threadsafe`): the model thread never waits for a client.

Admission: every accepted ticket goes to the engine at once, and the engine's
queue is the only one: its scheduler admits a request while the samples
generating stay within `max_sequences` (EngineOptions.max_samples), first come
first served. The HTTP side only counts: a ticket is accepted while fewer
requests wait than `queue` plus the samples still free under
`max_sequences`, else refused (429). A request waits until the engine starts
it (`Request.started`), or until its ticket's queue deadline (`[server]
queue_timeout_s`): one not started by then is dropped between two steps and
ends `timed_out` (the HTTP side answers 503). A step that raises out of the engine (the engine
itself retries a failed forward, and fails only the request that still
fails) ends every request it had started with an error, and the cache is
cleared and a fresh engine built, given the requests still waiting: the
server keeps serving.

Shutdown (`serve`): `refuse_waiting` ends at once the tickets the engine has
not started, and refuses new ones; `end_running`, past the grace period, ends
the rest. Both are answered `shutting_down()` (503 in OpenAI's shape, an
error event in a stream) by the HTTP side, before uvicorn closes the sockets.
"""

from __future__ import annotations

import asyncio
import collections
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import attrs

from kvlayout.engines.prefixes import PrefixCache
from kvlayout.engines.records import Request, Stats
from kvlayout.errors import BadRequest, QueueFull, RunEnded
from kvlayout.runner.text import SampleText
from kvlayout.server import cellmap
from kvlayout.server.observer import CellObserver
from kvlayout.server.requests import Order

FRAME_EVERY_S = 0.2  # the cell map is redrawn at most five times a second
RATE_WINDOW_S = 5.0  # tokens/s are over the last five seconds


def shutting_down() -> BadRequest:
    """What a request is answered when the server's shutdown ends it, or comes before it is taken."""
    return BadRequest("the server is shutting down; retry later", status=503, code="server_shutting_down",
                      kind="server_error")


def queue_timed_out() -> BadRequest:
    """What a request is answered when it waited past its queue deadline without being started."""
    return BadRequest("the request waited in the queue longer than server.queue_timeout_s without being started; "
                      "retry later", status=503, code="queue_timeout", kind="server_error")


@attrs.frozen
class Event:
    """A sample's news: new text (possibly empty), and its finish_reason once it ended."""

    index: int
    text: str
    finish_reason: str | None = None
    error: str | None = None
    logprobs: tuple = ()  # the sample's engines.shaping.TokenLogprob records since its last event


@attrs.define(eq=False)
class Ticket:
    """A request inside the server: the engine's record, each sample's text, where events go."""

    order: Order
    request: Request
    texts: list[SampleText]
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = attrs.field(factory=asyncio.Queue)
    finished: int = 0  # samples ended
    handed: bool = False  # the engine thread gave its request to the engine
    failed: str | None = None  # why the whole request failed (a step that raised, or its queue deadline)
    deadline: float | None = None  # time.monotonic() by which the engine must have started it, or None
    timed_out: bool = False  # it waited past its deadline: dropped before it started
    shut_down: bool = False  # the server's shutdown ended it: answered shutting_down()
    logged: list[int] = attrs.field(factory=list)  # per sample, its logprob records already posted

    @property
    def done(self) -> bool:
        return self.finished == self.order.n or self.failed is not None

    def post(self, event: Event | None) -> None:
        """Hand `event` to the client's coroutine (None: the request is over)."""
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop is closed: the server is going down and nobody listens
            pass


def new_ticket(order: Order, request: Request, decode: Callable, loop: asyncio.AbstractEventLoop,
               queue_timeout_s: float | None = None) -> Ticket:
    """A ticket whose samples' texts end at the order's stop strings (their stoppers, in the engine),
    dropped when the engine has not started it `queue_timeout_s` from now (None: it waits as long as it takes)."""
    texts = []
    for sample in request.samples:
        sample.stopper = text = SampleText(decode, order.stop)
        texts.append(text)
    deadline = None if queue_timeout_s is None else time.monotonic() + queue_timeout_s
    return Ticket(order, request, texts, loop, asyncio.Queue(), deadline=deadline)


class Worker:
    """Owns the engine and runs it on its own thread; see the module docstring."""

    def __init__(self, make_engine: Callable[[Stats, Callable], Any], cells: Callable[[], dict[str, int]],
                 max_sequences: int, queue_limit: int, clear: Callable[[], None], prefixes: PrefixCache | None = None,
                 view: Any = None, observer: CellObserver | None = None,
                 idle: Callable[[], None] = lambda: None, stopped: Callable[[], None] = lambda: None):
        """`make_engine(stats, on_token)` builds an engine over the cache; `cells()` answers
        (held, capacity) between steps; `clear()` empties the cache after a step that raised;
        `prefixes` is the engines' prefix cache, reported by /health and /stats; `view` the
        cache's CellView face and `observer` the plugin hearing its steps (the cell map);
        `idle()` is called while there is nothing to run (about every FRAME_EVERY_S) and
        `stopped()` once `run` is done (a tensor-parallel server's heartbeat and last word to its
        other ranks: server.replica). `run()` must be called on the thread that made the model and
        the cache."""
        self.make_engine, self.cells, self.clear, self.prefixes = make_engine, cells, clear, prefixes
        self.idle, self.stopped = idle, stopped
        self.view, self.observer = view, observer
        self.map: cellmap.Snapshot | None = None  # the table at the last frame (any thread reads it)
        self.frame: dict | None = None
        self.frame_seq = 0  # bumped with each new frame: /cells streams sends what it has not sent
        self.frame_at = 0.0
        self.frame_every = FRAME_EVERY_S
        self.rates: collections.deque = collections.deque()  # (time, generated, prefilled), RATE_WINDOW_S long
        self.rates_now = {"tokens_per_s": 0.0, "prefill_tokens_per_s": 0.0}
        self.max_sequences, self.queue_limit = max_sequences, queue_limit
        self.stats = Stats()
        self.engine = make_engine(self.stats, self.heard)
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.lock = threading.Lock()  # guards tickets, waiting, running_samples (the HTTP side submits)
        self.tickets: dict[int, Ticket] = {}  # accepted and not over, in order: the engine has (or gets) each
        self.waiting = 0  # of them, those the engine has not started
        self.running_samples = 0  # samples of the started ones
        # Tickets whose last sample ended during the step: told they are over once the step's state
        # is published, so a client that has its answer finds /health already showing it.
        self.ending: list[Ticket] = []
        self.failures = 0  # steps that raised out of the engine
        self.snapshot: dict = {}
        self.stopping = threading.Event()
        # Set first on shutdown: /cells streams end. A plain flag, not an Event: it is set from a
        # signal handler, which runs on the main thread between any two bytecodes, possibly inside
        # this thread's own Event.set or lock; taking a lock there deadlocks.
        self.closing = False
        self.refusing = False  # set once shutdown begins: submit refuses (503), see refuse_waiting
        self.publish()

    # -- the HTTP side (any thread)

    def submit(self, ticket: Ticket) -> None:
        """Hand `ticket` to the engine (it runs when the engine admits it); QueueFull (nothing
        changed) when `queue` requests wait beyond what `max_sequences` still has room for;
        `shutting_down()` (503) once the shutdown began."""
        with self.lock:
            if self.refusing or self.stopping.is_set():
                raise shutting_down()
            room = self.queue_limit + max(0, self.max_sequences - self.running_samples)
            if self.waiting >= room:
                raise QueueFull(f"{self.waiting} requests are waiting (server.queue={self.queue_limit})")
            self.tickets[ticket.request.index] = ticket
            self.waiting += 1
        self.inbox.put(("run", ticket))

    def cancel(self, ticket: Ticket) -> None:
        """Drop `ticket` (its client went away): before the next step, its cells are freed."""
        self.inbox.put(("cancel", ticket))

    def stop(self) -> None:
        """Stop admitting; `run` cancels what is in flight after its step and returns."""
        self.closing = True
        self.stopping.set()
        self.inbox.put(("stop", None))

    def refuse_waiting(self) -> None:
        """Shutdown begins (the HTTP side, not a signal handler: it locks): no ticket is taken any
        more, and those the engine has not started end now, answered at once; the started ones
        go on (the grace period)."""
        self.refusing = True
        self.end_for_shutdown(started_too=False)

    def end_running(self) -> None:
        """The grace period is over: every ticket left ends now, its answer said at once (the HTTP
        side, not waiting for the engine's step); the engine frees their cells after its step."""
        self.refusing = True
        self.end_for_shutdown(started_too=True)

    def end_for_shutdown(self, started_too: bool) -> None:
        with self.lock:
            tickets = [t for t in self.tickets.values() if started_too or not t.request.started]
            for ticket in tickets:
                del self.tickets[ticket.request.index]
            self.count()
        for ticket in tickets:
            ticket.failed, ticket.shut_down = shutting_down().message, True
            ticket.post(None)
            self.inbox.put(("forget", ticket))  # the engine drops it (a started one, or one it took meanwhile)

    def close_streams(self) -> None:
        """The server is shutting down: the endless streams (the cell map's) end now, so the
        grace period is the completions' alone. Safe in a signal handler: it takes no lock."""
        self.closing = True

    # -- the engine thread

    def run(self) -> None:
        """Step the engine, taking up submissions and cancellations between steps, until `stop`."""
        while True:
            idle = not self.engine.has_work
            commands = []
            if idle:
                try:  # a timeout, so the main thread running this still hears its signals promptly
                    commands.append(self.inbox.get(timeout=FRAME_EVERY_S))
                except queue.Empty:
                    self.publish()  # the last change of a burst is drawn too
                    self.idle()
                    continue
            while True:
                try:
                    commands.append(self.inbox.get_nowait())
                except queue.Empty:
                    break
            for verb, ticket in commands:
                if verb == "stop":
                    self.cancel_all("the server is shutting down", cancel_in_engine=True)
                    if self.prefixes is not None:
                        self.prefixes.flush()  # a prefix store keeps what the cells held (a no-op without one)
                    self.publish()
                    self.stopped()
                    return
                if verb == "run":
                    if ticket.failed is None:  # not ended meanwhile by a step that raised, or the shutdown
                        self.engine.add([ticket.request])
                        ticket.handed = True
                elif verb == "forget":  # ended for the shutdown, its client answered already
                    if ticket.handed:
                        self.engine.cancel(ticket.request)  # heard() ignores it: its ticket is gone
                    self.mark_stale()
                else:
                    self.drop(ticket)
                    self.mark_stale()  # freed cells: no hook tells of a verb
            self.expire(time.monotonic())
            if self.engine.has_work:
                self.step()
            self.publish()

    def step(self) -> None:
        try:
            self.engine.step()
        except RunEnded:  # a tensor-parallel rank lost its peers: no step can run any more
            raise
        except Exception as exc:  # noqa: BLE001 - whatever a step raises, the server must go on
            self.failures += 1
            self.cancel_all(f"the step failed ({type(exc).__name__}: {exc}); the cache was cleared",
                            cancel_in_engine=False, queued_too=False)
            self.clear()
            self.mark_stale()
            self.engine = self.make_engine(self.stats, self.heard)
            # What waited lost nothing: the fresh engine's queue takes it up, in order.
            with self.lock:
                waiting = [t.request for t in self.tickets.values() if t.handed]
            self.engine.add(waiting)

    def heard(self, request: Request, sample, token: int | None) -> None:
        """The engine's on_token: a sample's new text and, when it ended, why."""
        ticket = self.tickets.get(request.index)
        if ticket is None:
            return
        final = sample.finish_reason is not None
        text = ticket.texts[sample.index].take_new(final=final)
        logprobs = ()
        if sample.logprobs:
            if not ticket.logged:
                ticket.logged = [0] * ticket.order.n
            logprobs = tuple(sample.logprobs[ticket.logged[sample.index]:])
            ticket.logged[sample.index] = len(sample.logprobs)
        ticket.post(Event(sample.index, text, sample.finish_reason, sample.error, logprobs))
        if final:
            ticket.finished += 1
            if ticket.done:
                self.release(ticket, later=True)

    def drop(self, ticket: Ticket) -> None:
        """The client went away: the engine ends what is left of its request (queued or running)."""
        if ticket.request.index in self.tickets and not ticket.done:
            self.engine.cancel(ticket.request)  # frees its cells now; heard() hears each sample end
            if not ticket.done:  # samples the engine no longer held
                self.release(ticket)

    def release(self, ticket: Ticket, later: bool = False) -> None:
        """The ticket's samples hold nothing in the engine any more: it is over (`later`: once
        `publish` has shown that, see `ending`)."""
        with self.lock:
            self.tickets.pop(ticket.request.index, None)
            self.count()
        if later:
            self.ending.append(ticket)
            return
        ticket.post(None)

    def count(self) -> None:
        """Recount the tickets the engine has not started and the samples of those it has
        (under the lock)."""
        started = [t for t in self.tickets.values() if t.request.started]
        self.waiting = len(self.tickets) - len(started)
        self.running_samples = sum(t.order.n for t in started)

    def expire(self, now: float) -> None:
        """Drop every ticket the engine has not started whose queue deadline has passed: it ends
        `timed_out`, having held no cell. Runs on the engine thread between steps, so no step can
        start one while it goes."""
        with self.lock:
            late = [t for t in self.tickets.values()
                    if t.handed and not t.request.started and t.deadline is not None and now >= t.deadline]
            for ticket in late:
                del self.tickets[ticket.request.index]
            self.count()
        for ticket in late:
            self.engine.cancel(ticket.request)  # heard() ignores it now: its ticket is gone
            ticket.timed_out = True
            ticket.failed = queue_timed_out().message
            self.ending.append(ticket)  # told once /health shows it gone (`ending`)

    def cancel_all(self, why: str, cancel_in_engine: bool, queued_too: bool = True) -> None:
        """End every request the engine started with `why` (and those still waiting, with
        `queued_too`: after a step that raised they lost nothing and stay queued); the engine
        cancels them too when it is still usable (not after a step that raised: the cache is
        cleared and the engine replaced)."""
        with self.lock:
            tickets = [t for t in self.tickets.values() if queued_too or t.request.started]
            for ticket in tickets:
                del self.tickets[ticket.request.index]
            self.count()
        for ticket in tickets:
            ticket.failed = why
            ticket.post(None)
        if cancel_in_engine:
            for ticket in tickets:
                self.engine.cancel(ticket.request)

    def mark_stale(self) -> None:
        if self.observer is not None:
            self.observer.mark_stale()

    def draw(self, now: float) -> None:
        """A new cell map frame when the table changed, at most one per FRAME_EVERY_S (or ten
        times what the last one took to draw, when that is longer)."""
        if self.view is None or now - self.frame_at < self.frame_every or not self.observer.take_stale():
            return
        kept = list(self.prefixes.entries) if self.prefixes is not None else []
        self.map = cellmap.take(self.view, kept)
        self.frame = cellmap.frame(self.map, self.stats.steps)
        self.frame_at = time.monotonic()
        self.frame_seq += 1
        # A large pool costs more to draw: never spend more than a tenth of the engine thread on it.
        self.frame_every = max(FRAME_EVERY_S, 10 * (self.frame_at - now))

    def rate(self, now: float) -> tuple[float, float]:
        """(generated, prefilled) tokens per second over the last RATE_WINDOW_S."""
        s = self.stats
        self.rates.append((now, s.generated_tokens, s.prefill_tokens))
        while len(self.rates) > 2 and now - self.rates[1][0] >= RATE_WINDOW_S:
            self.rates.popleft()
        t0, g0, p0 = self.rates[0]
        span = now - t0
        return ((s.generated_tokens - g0) / span, (s.prefill_tokens - p0) / span) if span > 0 else (0.0, 0.0)

    def publish(self) -> None:
        """What /health and /stats show, taken on the engine thread between steps (one reference,
        swapped), and the cell map's next frame when it is due."""
        now = time.monotonic()
        self.draw(now)
        generated_s, prefilled_s = self.rate(now)
        s = self.stats
        cells = self.cells()
        with self.lock:
            self.count()  # the engine started what it admitted this step
            waiting, running = self.waiting, len(self.tickets) - self.waiting
        self.snapshot = {
            "status": "ok" if not self.stopping.is_set() else "stopping",
            "requests": {"running": running, "waiting": waiting},
            "cells": cells,
            "steps": s.steps,
            "generated_tokens": s.generated_tokens,
            "prefill_tokens": s.prefill_tokens,
            "preemptions": s.preemptions,
            "drafted_tokens": s.drafted_tokens,
            "accepted_tokens": s.accepted_tokens,
            "failed_steps": self.failures,
            "prefix_cache": self.prefixes.snapshot() if self.prefixes is not None else None,
        }
        self.rates_now = {"tokens_per_s": generated_s, "prefill_tokens_per_s": prefilled_s}
        ending, self.ending = self.ending, []
        for ticket in ending:
            ticket.post(None)
