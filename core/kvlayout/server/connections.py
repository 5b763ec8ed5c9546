"""Bounds on what one client's connection may hold: deadlines while it sends, a cap on how many are open.

uvicorn's h11 protocol closes a keep-alive connection left idle after an
answer (`timeout_keep_alive`), and nothing else: a connection that sends
nothing, half a request head, or a head promising a body that never comes
holds its descriptor for ever, and enough of them exhaust the process's
descriptors (then every accept fails, and asyncio logs each failure with a
traceback). `BoundedProtocol` adds what is missing:

- a request head must be whole within `header_timeout_s` of its first byte
  (of the connection's opening, for the first): an absolute deadline, which
  bytes trickled in do not extend. A connection that sent nothing is closed
  without a word (browsers open spare ones); part of a head is answered 408;
- a body may go `idle_timeout_s` without a byte (408 when no answer has
  started), as may a client that stops reading its answer (the connection is
  closed: the app sees the disconnect, which cancels the request);
- a connection past `max_connections` is answered 503 in OpenAI's shape at
  once and closed within `REFUSED_LINGER_S` (at most `max_connections` +
  `REFUSING_SPARE` of them at a time; past those, closed without a word): a
  server holds at most about twice `max_connections` descriptors for clients.

`RateLimitedLog` keeps a flood of one kind of log record (an accept failing
for want of descriptors, a refused connection) to one line per interval,
counting the ones it held back.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import time
from collections.abc import Callable

import attrs
import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from kvlayout.server import shapes

logger = logging.getLogger("kvlayout.server")

REFUSED_LINGER_S = 1.0  # how long a refused connection may go on sending its request before it is closed
REFUSING_SPARE = 16  # refused connections held beyond max_connections of them: a small cap still answers 503
RESERVED_DESCRIPTORS = 32  # for what the process opens after it starts serving: files, the prefix store, pipes
OUT_OF_DESCRIPTORS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)  # asyncio's list: it retries after 1 s


@attrs.frozen
class ConnectionLimits:
    header_timeout_s: float
    idle_timeout_s: float
    max_connections: int


def raw_answer(status: int, reason: str, body: dict, extra_headers: str = "") -> bytes:
    """A whole HTTP/1.1 answer that closes its connection, written past h11 (which allows no answer to a
    request whose head never came; the connection is closed right after)."""
    data = json.dumps(body).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(data)}\r\n"
            f"{extra_headers}connection: close\r\n\r\n")
    return head.encode() + data


class BoundedProtocol(H11Protocol):
    """uvicorn's h11 protocol with the deadlines and the cap above (`limits`, set by `bounded_protocol`)."""

    limits: ConnectionLimits
    refusals: RateLimitedLog
    refusing: set  # the refused connections still open, shared by a server's connections

    deadline: object = None  # the asyncio.TimerHandle of the wait being timed, if any
    waiting_for: str = ""  # "head" or "body": what that deadline is for
    stall: object = None  # the TimerHandle of a client not reading its answer
    refused: bool = False

    def connection_made(self, transport) -> None:  # type: ignore[override]
        if len(self.connections) >= self.limits.max_connections:
            self.refuse(transport)
            return
        super().connection_made(transport)
        self.time("head", self.limits.header_timeout_s)

    def refuse(self, transport) -> None:
        """503 now, then read and drop what the client sends for up to `REFUSED_LINGER_S`: closing on
        unread bytes would reset the connection, and a client still sending its request would get a
        broken pipe, not the answer. Past `max_connections` + `REFUSING_SPARE` lingering, closed at once."""
        self.refused, self.transport = True, transport
        limit = self.limits.max_connections
        self.refusals.log(logging.WARNING, "kvlayout: refused a connection: server.max_connections=%d are open",
                          limit)
        if len(self.refusing) >= limit + REFUSING_SPARE:
            transport.abort()
            return
        self.refusing.add(self)
        message = f"the server has {limit} connections open (server.max_connections={limit}); retry shortly"
        body = shapes.error(message, "server_error", None, "too_many_connections")
        transport.write(raw_answer(503, "Service Unavailable", body, "retry-after: 1\r\n"))
        if transport.can_write_eof():
            transport.write_eof()  # the answer is whole; the client may still finish sending
        self.deadline = self.loop.call_later(REFUSED_LINGER_S, transport.close)

    def connection_lost(self, exc: Exception | None) -> None:
        self.untime()
        if self.stall is not None:
            self.stall.cancel()
        if self.refused:
            self.refusing.discard(self)
        else:
            super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.refused:
            return
        super().data_received(data)
        self.watch()

    def watch(self) -> None:
        """Time what the connection now waits for from its client, after what it sent."""
        if self.transport.is_closing():
            self.untime()
        elif self.conn.their_state is h11.IDLE:  # a head begun (a whole one has moved h11 on)
            if self.waiting_for != "head":
                self.time("head", self.limits.header_timeout_s)
        elif self.conn.their_state is h11.SEND_BODY:
            self.time("body", self.limits.idle_timeout_s)  # afresh: each byte of a body restarts its wait
        else:  # the request is whole: what follows is the server's to do, not the client's
            self.untime()

    def time(self, what: str, seconds: float) -> None:
        self.untime()
        self.waiting_for = what
        self.deadline = self.loop.call_later(seconds, self.too_slow)

    def untime(self) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
        self.deadline, self.waiting_for = None, ""

    def too_slow(self) -> None:
        what, self.deadline, self.waiting_for = self.waiting_for, None, ""
        if self.transport.is_closing():
            return
        started = self.cycle is not None and self.cycle.response_started
        sent_some = what == "body" or bool(self.conn.trailing_data[0])
        if sent_some and not started:
            key, seconds = (("server.header_timeout_s", self.limits.header_timeout_s) if what == "head"
                            else ("server.idle_timeout_s", self.limits.idle_timeout_s))
            message = (f"the request's {what} did not arrive within {seconds:g} s ({key}={seconds:g})"
                       if what == "head" else
                       f"the request's body stopped arriving for {seconds:g} s ({key}={seconds:g})")
            self.transport.write(raw_answer(408, "Request Timeout", shapes.error(message, code="request_timeout")))
        self.transport.close()  # the app, if a request is in flight, sees a disconnect

    def pause_writing(self) -> None:
        if self.refused:
            return
        super().pause_writing()
        if self.stall is None:
            self.stall = self.loop.call_later(self.limits.idle_timeout_s, self.not_reading)

    def resume_writing(self) -> None:
        if self.refused:
            return
        super().resume_writing()
        if self.stall is not None:
            self.stall.cancel()
            self.stall = None

    def not_reading(self) -> None:
        self.stall = None
        self.transport.abort()  # what it has not read is not worth sending; nor is waiting for its buffer


def bounded_protocol(limits: ConnectionLimits) -> type[BoundedProtocol]:
    """The protocol class uvicorn makes each connection with (`uvicorn.Config(http=...)`), for `limits`."""
    refusals = RateLimitedLog(logger, interval_s=10.0)
    return type("BoundedProtocol", (BoundedProtocol,), {"limits": limits, "refusals": refusals, "refusing": set()})


def descriptor_room() -> int | None:
    """How many more descriptors this process may open (its soft limit less those open, less a reserve);
    None where that cannot be told."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        open_now = len(os.listdir("/dev/fd"))
    except (ImportError, OSError, ValueError):
        return None
    if soft == resource.RLIM_INFINITY:
        return None
    return max(1, soft - open_now - RESERVED_DESCRIPTORS)


class RateLimitedLog:
    """At most one line per `interval_s` for one kind of event, saying how many like it were held back."""

    def __init__(self, target: logging.Logger, interval_s: float, clock: Callable[[], float] = time.monotonic):
        self.target, self.interval_s, self.clock = target, interval_s, clock
        self.last = -float("inf")
        self.held_back = 0

    def admit(self) -> str | None:
        """None when this event's line is held back; else what to add to it (the count held back)."""
        now = self.clock()
        if now - self.last < self.interval_s:
            self.held_back += 1
            return None
        held, self.held_back, self.last = self.held_back, 0, now
        return f" ({held} more like it in the last {self.interval_s:g} s)" if held else ""

    def log(self, level: int, msg: str, *args) -> None:
        suffix = self.admit()
        if suffix is not None:
            self.target.log(level, msg + suffix, *args)


class OutOfDescriptorsFilter(logging.Filter):
    """On asyncio's logger: its 'socket.accept() out of system resource' records (one per failed accept,
    each with a traceback) become one line per interval, naming the error and what to do about it."""

    def __init__(self, interval_s: float = 10.0, clock: Callable[[], float] = time.monotonic):
        super().__init__()
        self.rate = RateLimitedLog(logger, interval_s, clock)

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not (isinstance(exc, OSError) and exc.errno in OUT_OF_DESCRIPTORS):
            return True
        suffix = self.rate.admit()
        if suffix is None:
            return False
        record.msg = (f"kvlayout: cannot accept a connection: {exc.strerror} (errno {exc.errno}); retrying each "
                      f"second. Raise the descriptor limit (ulimit -n) or lower server.max_connections{suffix}")
        record.args, record.exc_info, record.exc_text = (), None, None
        return True


UVICORN_PER_REQUEST_WARNINGS = (  # what uvicorn logs for each such request: a client could fill stderr with them
    "Invalid HTTP request received.",
    "Unsupported upgrade request.",
    "No supported WebSocket library detected.",
)


class PerRequestWarningsFilter(logging.Filter):
    """On uvicorn's error logger: each of `UVICORN_PER_REQUEST_WARNINGS` once per interval, with a count."""

    def __init__(self, interval_s: float = 10.0, clock: Callable[[], float] = time.monotonic):
        super().__init__()
        self.rates = {text: RateLimitedLog(logger, interval_s, clock) for text in UVICORN_PER_REQUEST_WARNINGS}

    def filter(self, record: logging.LogRecord) -> bool:
        text = str(record.msg)
        rate = next((r for start, r in self.rates.items() if text.startswith(start)), None)
        if rate is None:
            return True
        suffix = rate.admit()
        if suffix is None:
            return False
        record.msg, record.args = record.getMessage() + suffix, ()
        return True
