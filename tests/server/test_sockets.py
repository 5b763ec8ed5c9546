"""What a client's connection may hold, and for how long: request heads and bodies on a deadline, a cap on
connections open at once, and a flood of failed accepts logged as one line."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import socket
import threading
import time

import pytest
import uvicorn

from kvlayout.server import serve
from kvlayout.server.config import ServerSection
from kvlayout.server.connections import (
    ConnectionLimits,
    OutOfDescriptorsFilter,
    PerRequestWarningsFilter,
    RateLimitedLog,
    bounded_protocol,
)
from tests.server.conftest import serving

HEAD_S, IDLE_S = 1.0, 1.5
LIMITS = {"server": {"header_timeout_s": HEAD_S, "idle_timeout_s": IDLE_S}}
MARGIN_S = 2.0  # a loaded 2-core machine's slack on top of a timeout; the bound asserted is timeout + this
REQUEST = b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"


def connect(live) -> socket.socket:
    return socket.create_connection(("127.0.0.1", live.port), timeout=30)


def until_closed(sock: socket.socket) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and the seconds that took."""
    start, got = time.monotonic(), b""
    while chunk := sock.recv(65536):
        got += chunk
    return got, time.monotonic() - start


def status_and_error(answer: bytes) -> tuple[int, dict]:
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), json.loads(body)["error"]


def test_a_connection_that_sends_nothing_is_closed_after_the_header_timeout(tiny_loaded):
    with serving(tiny_loaded, LIMITS) as live:
        with connect(live) as sock:
            got, took = until_closed(sock)
        assert got == b""  # nothing was asked: nothing is answered (browsers open spare connections)
        assert HEAD_S * 0.8 <= took <= HEAD_S + MARGIN_S


def test_half_a_head_is_answered_408_after_the_header_timeout_however_slowly_it_trickles(tiny_loaded):
    with serving(tiny_loaded, LIMITS) as live:
        with connect(live) as sock:
            sock.sendall(REQUEST[:30])
            got, took = until_closed(sock)
        assert HEAD_S * 0.8 <= took <= HEAD_S + MARGIN_S
        status, error = status_and_error(got)
        assert status == 408 and "server.header_timeout_s=1" in error["message"]
        assert set(error) == {"message", "type", "param", "code"}
        # A byte every 0.3 s does not extend the deadline: it runs from the head's first byte.
        with connect(live) as sock:
            start = time.monotonic()
            sock.sendall(REQUEST[:1])
            for byte in REQUEST[1:10]:
                time.sleep(0.3)
                try:
                    sock.sendall(bytes([byte]))
                except OSError:  # closed already: what matters is when
                    break
            got, _ = until_closed(sock)
            took = time.monotonic() - start
        assert HEAD_S * 0.8 <= took <= HEAD_S + MARGIN_S and got.startswith(b"HTTP/1.1 408")


def test_a_head_promising_a_body_that_never_comes_is_answered_408_and_nothing_is_left_running(tiny_loaded):
    with serving(tiny_loaded, LIMITS) as live:
        before = live.health()
        with connect(live) as sock:
            sock.sendall(REQUEST + b"Content-Length: 100\r\n\r\n" + b'{"model": "tiny"')
            got, took = until_closed(sock)
        assert IDLE_S * 0.8 <= took <= IDLE_S + MARGIN_S
        status, error = status_and_error(got)
        assert status == 408 and "server.idle_timeout_s=1.5" in error["message"]
        assert live.health() == before  # nothing was admitted, nothing changed


def test_a_keep_alive_connection_idle_after_its_answer_is_closed_after_the_idle_timeout(tiny_loaded):
    with serving(tiny_loaded, LIMITS) as live:
        with connect(live) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            start, got = time.monotonic(), b""
            while chunk := sock.recv(65536):
                got += chunk
            took = time.monotonic() - start
        assert got.startswith(b"HTTP/1.1 200") and IDLE_S * 0.8 <= took <= IDLE_S + MARGIN_S


def test_a_connection_past_max_connections_is_answered_503_and_served_once_the_idle_ones_are_gone(tiny_loaded):
    cap = 3
    with serving(tiny_loaded, {"server": {"max_connections": cap, "header_timeout_s": 2}}) as live:
        idle = [connect(live) for _ in range(cap)]  # accepted in order, before the next one
        try:
            status, body, headers = live.post("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2})
            assert status == 503 and int(headers["retry-after"]) >= 1
            assert f"server.max_connections={cap}" in body["error"]["message"]
            assert set(body["error"]) == {"message", "type", "param", "code"}
            # Answered, not reset, however much the refused client is still sending.
            for size in (1_000, 16_000, 200_000):
                status, body, _ = live.post("/v1/completions", {"model": "tiny", "prompt": "x" * size})
                assert status == 503 and body["error"]["code"] == "too_many_connections"
            # The idle ones are closed by their header timeout; then a request is served.
            for sock in idle:
                sock.settimeout(2 + MARGIN_S)
                assert until_closed(sock)[0] == b""
        finally:
            for sock in idle:
                sock.close()
        status, body, _ = live.post("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2})
        assert status == 200 and body["usage"]["completion_tokens"] >= 1


def test_max_connections_is_lowered_to_what_the_descriptor_limit_leaves(monkeypatch, caplog):
    room = 56  # 16 spare for refusals, then half each: 20 connections and 20 refusals at once
    monkeypatch.setattr(serve, "descriptor_room", lambda: room)
    with caplog.at_level(logging.WARNING, logger="kvlayout.server"):
        assert serve.connection_limits(ServerSection(max_connections=256)).max_connections == 20
        assert serve.connection_limits(ServerSection(max_connections=20)).max_connections == 20
    assert [r.getMessage() for r in caplog.records] == [
        "kvlayout: server.max_connections=256 is more than this process can hold (ulimit -n leaves room for 56 "
        "descriptors, about half of them for refused connections); capping connections at 20"]


def test_a_client_that_stops_reading_its_answer_is_disconnected_after_the_idle_timeout():
    """On an endless answer (an app of its own: the tiny model's answers fit in the socket's buffers), a
    client that never reads: the server closes the connection, and the app sees the disconnect."""
    gone: dict[str, float] = {}

    async def endless(scope, receive, send):
        async def watch():
            while (await receive())["type"] != "http.disconnect":
                pass
            gone["at"] = time.monotonic()

        watcher = asyncio.ensure_future(watch())
        await send({"type": "http.response.start", "status": 200, "headers": []})
        while not watcher.done():
            await send({"type": "http.response.body", "body": b"x" * 65536, "more_body": True})
            await asyncio.sleep(0)

    limits = ConnectionLimits(header_timeout_s=HEAD_S, idle_timeout_s=IDLE_S, max_connections=8)
    config = uvicorn.Config(endless, http=bounded_protocol(limits), lifespan="off", log_level="warning")
    server = uvicorn.Server(config)
    listening = serve.bind("127.0.0.1", 0)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listening]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            sock.connect(listening.getsockname())
            sock.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            sent = time.monotonic()
            while "at" not in gone and time.monotonic() < sent + IDLE_S + 3 * MARGIN_S:
                time.sleep(0.05)
        assert "at" in gone, "the app never saw the client go"
        assert gone["at"] - sent >= IDLE_S * 0.8
    finally:
        server.should_exit = True
        thread.join(10)
        listening.close()
    assert not thread.is_alive()


class Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.extend(self.format(record).splitlines())


@contextlib.contextmanager
def heard(name: str, limit: logging.Filter):
    """The lines logger `name` writes while `limit` filters it."""
    log, lines = logging.getLogger(name), Lines()
    log.addHandler(lines)
    log.addFilter(limit)
    try:
        yield lines.lines
    finally:
        log.removeFilter(limit)
        log.removeHandler(lines)


def test_a_thousand_failed_accepts_in_a_second_log_one_line_then_one_per_interval_with_the_count():
    now = [0.0]
    loop = asyncio.new_event_loop()
    with heard("asyncio", OutOfDescriptorsFilter(interval_s=10.0, clock=lambda: now[0])) as lines:
        try:
            # What asyncio's accept does on EMFILE, through its own default exception handler.
            for i in range(1000):
                now[0] = i / 1000
                loop.call_exception_handler({"message": "socket.accept() out of system resource",
                                             "exception": OSError(errno.EMFILE, "Too many open files")})
            assert len(lines) == 1 and "Too many open files" in lines[0] and "Traceback" not in lines[0]
            now[0] = 10.5
            loop.call_exception_handler({"message": "socket.accept() out of system resource",
                                         "exception": OSError(errno.EMFILE, "Too many open files")})
            assert len(lines) == 2 and "999 more like it in the last 10 s" in lines[1]
            # Anything else asyncio says passes as it was.
            loop.call_exception_handler({"message": "something else", "exception": ValueError("x")})
            assert lines[2] == "something else" and any("ValueError: x" in line for line in lines[3:])
        finally:
            loop.close()


def test_a_flood_of_invalid_requests_logs_one_warning_per_interval():
    now = [0.0]
    uvicorn_log = logging.getLogger("uvicorn.error")
    with heard("uvicorn.error", PerRequestWarningsFilter(interval_s=10.0, clock=lambda: now[0])) as lines:
        for i in range(1000):
            now[0] = i / 1000
            uvicorn_log.warning("Invalid HTTP request received.")
            uvicorn_log.warning("Unsupported upgrade request.")
        uvicorn_log.warning("Exceeded concurrency limit.")  # not per request from one client: as it was
        assert lines == ["Invalid HTTP request received.", "Unsupported upgrade request.",
                         "Exceeded concurrency limit."]
        now[0] = 11
        uvicorn_log.warning("Invalid HTTP request received.")
        assert lines[-1] == "Invalid HTTP request received. (999 more like it in the last 10 s)"


@pytest.mark.parametrize("held_back, expected", [(0, ""), (1, " (1 more like it in the last 5 s)")])
def test_a_rate_limited_log_says_how_many_it_held_back(held_back, expected):
    now = [100.0]
    rate = RateLimitedLog(logging.getLogger("unused"), interval_s=5.0, clock=lambda: now[0])
    assert rate.admit() == ""
    for _ in range(held_back):
        now[0] += 1
        assert rate.admit() is None
    now[0] += 5
    assert rate.admit() == expected
