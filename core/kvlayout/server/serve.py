"""`kvlayout serve`: the engine on the main thread, HTTP on a thread of its own, until SIGINT/SIGTERM.

The model runs where it was loaded (MLX's streams belong to their thread),
the main thread; uvicorn serves on a second one with its own event loop.
Each request answered is one line on stderr (`app.access_line`: method, path,
status, tokens generated, wall time).
The socket is bound before the model loads (`bind`), so a port in use or a
host that is not this machine's is one line naming them (exit 2), not a
logged traceback. On SIGINT/SIGTERM uvicorn stops accepting connections;
the requests still queued are answered at once (503 in OpenAI's shape, or a
stream's error event and [DONE]), those generating get `server.shutdown_grace_s`
to finish and are then answered the same way, before uvicorn closes the
sockets (it cancels only what is still unanswered `ANSWER_S` later, and a
cancelled request logs no traceback). The engine stops after its step and the
process exits 0 (a server asked to stop that stops has not failed). A second
Ctrl-C does not wait for the grace period.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import logging.handlers
import queue
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable

import uvicorn

from kvlayout.errors import ConfigError, os_reason
from kvlayout.server.app import ACCESS_LOG, build_app
from kvlayout.server.config import ServerSection
from kvlayout.server.connections import (
    REFUSING_SPARE,
    ConnectionLimits,
    OutOfDescriptorsFilter,
    PerRequestWarningsFilter,
    bounded_protocol,
    descriptor_room,
)
from kvlayout.server.service import Service
from kvlayout.server.worker import Worker

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
ANSWER_S = 2.0  # past the grace period, how long the answers of the requests it ended get to be written
GRACE_POLL_S = 0.05
logger = logging.getLogger("kvlayout.server")


class Server(uvicorn.Server):
    """uvicorn's server, telling `on_ready` once it accepts connections and, given the `worker`, ending
    its requests itself at shutdown (see the module docstring; `grace_s` after it begins). It runs off
    the main thread, where uvicorn leaves signals alone: `serve` takes them."""

    def __init__(self, config: uvicorn.Config, on_ready: Callable[[], None], worker: Worker | None = None,
                 grace_s: float = 0.0):
        super().__init__(config)
        self.on_ready, self.worker, self.grace_s = on_ready, worker, grace_s

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:
            self.on_ready()

    async def shutdown(self, sockets=None) -> None:
        if self.worker is None:
            return await super().shutdown(sockets)
        self.worker.refuse_waiting()
        grace = asyncio.ensure_future(self.end_after_grace())
        try:
            await super().shutdown(sockets)
        finally:
            grace.cancel()

    async def end_after_grace(self) -> None:
        """Past the grace period (or at a second Ctrl-C), end what still runs: each client is answered
        while its connection is open, rather than cut off by uvicorn's cancel."""
        deadline = time.monotonic() + self.grace_s
        while time.monotonic() < deadline and not self.force_exit:
            await asyncio.sleep(GRACE_POLL_S)
        self.worker.end_running()


def bind(host: str, port: int) -> socket.socket:
    """A listening-ready socket on host:port; ConfigError naming them when it cannot be had."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise ConfigError(f"--host {host!r}: not an address of this machine ({exc})") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {os_reason(exc)}") from None
    sock.set_inheritable(True)
    return sock


def connection_limits(server: ServerSection) -> ConnectionLimits:
    """`[server]`'s connection limits, `max_connections` lowered (said once) to what descriptors allow:
    accepting past them would fail, where a connection past the cap is answered 503."""
    cap, room = server.max_connections, descriptor_room()
    # Half of what is left for refusals: each connection past the cap holds one while it is answered 503.
    most = None if room is None else max(1, (room - REFUSING_SPARE) // 2)
    if most is not None and most < cap:
        logger.warning("kvlayout: server.max_connections=%d is more than this process can hold (ulimit -n leaves "
                       "room for %d descriptors, about half of them for refused connections); capping connections "
                       "at %d", cap, room, most)
        cap = most
    return ConnectionLimits(server.header_timeout_s, server.idle_timeout_s, cap)


def http_config(service: Service, **uvicorn_options) -> uvicorn.Config:
    """uvicorn's config for `service`: its app, quiet logs, and `[server]`'s bounds on each connection
    (`connections.BoundedProtocol`); `uvicorn_options` add to them."""
    limits = connection_limits(service.cfg.server)
    return uvicorn.Config(
        build_app(service),
        http=bounded_protocol(limits),
        timeout_keep_alive=limits.idle_timeout_s,  # idle between requests: uvicorn's own timer
        log_level="warning",
        access_log=False,
        lifespan="on",
        **uvicorn_options,
    )


class DroppingQueueHandler(logging.handlers.QueueHandler):
    """A QueueHandler that drops a line when its queue is full rather than wait or print an error."""

    def enqueue(self, record: logging.LogRecord) -> None:
        with contextlib.suppress(queue.Full):
            self.queue.put_nowait(record)


ACCESS_QUEUE = 10_000  # access lines waiting for stderr at most; past that (stderr not read) they are dropped


def access_log_on_stderr() -> Callable[[], None]:
    """The app's access lines (one per request, `app.access_line`) on stderr, as they are; what undoes it.

    The event loop only queues each line; a thread of its own writes them, so a stderr nobody reads (a
    full pipe) stalls that thread, never the loop serving requests. uvicorn's own access log stays off:
    it cannot say what a request generated."""
    access = logging.getLogger(ACCESS_LOG)
    lines: queue.Queue = queue.Queue(ACCESS_QUEUE)
    writer = logging.StreamHandler(sys.stderr)
    writer.setFormatter(logging.Formatter("%(message)s"))
    listener = logging.handlers.QueueListener(lines, writer)
    handler = DroppingQueueHandler(lines)
    access.addHandler(handler)
    access.setLevel(logging.INFO)
    access.propagate = False  # once, on stderr: not again through whatever the root logger has
    listener.start()

    def undo() -> None:
        access.removeHandler(handler)
        access.setLevel(logging.NOTSET)
        access.propagate = True
        listener.stop()  # writes what is queued, then ends its thread
    return undo


def serve(service: Service, sock: socket.socket, on_ready: Callable[[str], None]) -> int:
    """Serve `service` on the bound `sock` until a stop signal; `on_ready(url)` once connections are taken.
    Runs the engine on this thread (the one that prepared `service`)."""
    host, port = sock.getsockname()[:2]
    url = f"http://{host if ':' not in host else f'[{host}]'}:{port}"
    grace_s = service.cfg.server.shutdown_grace_s  # 0: none
    config = http_config(service, timeout_graceful_shutdown=grace_s + ANSWER_S)  # a backstop: Server ends them first
    server = Server(config, lambda: on_ready(url), service.worker, grace_s)

    def not_the_forced_exit(record: logging.LogRecord) -> bool:
        # A request (or, at a second Ctrl-C, the app's lifespan) cancelled by the shutdown is cancelled
        # on purpose; uvicorn would log each as a traceback.
        if not server.should_exit:
            return True
        cancelled = record.exc_info is not None and isinstance(record.exc_info[1], asyncio.CancelledError)
        return not (cancelled or "CancelledError" in record.getMessage())

    uvicorn_errors = logging.getLogger("uvicorn.error")
    uvicorn_errors.addFilter(not_the_forced_exit)
    per_request = PerRequestWarningsFilter()  # a client sending bad requests fills no disk with warnings
    uvicorn_errors.addFilter(per_request)
    asyncio_log, out_of_descriptors = logging.getLogger("asyncio"), OutOfDescriptorsFilter()
    asyncio_log.addFilter(out_of_descriptors)
    quiet_access = access_log_on_stderr()

    def http() -> None:
        try:
            server.run(sockets=[sock])
        finally:  # however uvicorn ends (a failed startup included), the engine must not wait on
            service.worker.stop()

    def stop(sig, frame) -> None:
        # A signal handler: it runs on the main thread (the engine's) between any two bytecodes, so
        # it only sets flags; taking a lock here could deadlock on one the interrupted code holds.
        if server.should_exit and sig == signal.SIGINT:
            server.force_exit = True  # a second Ctrl-C: no grace
        server.should_exit = True
        service.worker.close_streams()

    thread = threading.Thread(target=http, name="kvlayout-http", daemon=True)
    original = {sig: signal.signal(sig, stop) for sig in STOP_SIGNALS}
    try:
        thread.start()
        service.worker.run()
        thread.join()
    finally:
        # Asked to stop, the process is ending: a late stop signal (a burst of them) is ignored, not
        # let through to the default handler, which would kill it mid-teardown (exit -15, not 0).
        for sig, handler in original.items():
            signal.signal(sig, signal.SIG_IGN if server.should_exit else handler)
        sock.close()
        service.close()
        uvicorn_errors.removeFilter(not_the_forced_exit)
        asyncio_log.removeFilter(out_of_descriptors)
        uvicorn_errors.removeFilter(per_request)
        quiet_access()
    return 0
