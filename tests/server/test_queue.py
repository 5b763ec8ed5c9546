"""A queued request waits at most `server.queue_timeout_s`: then 503 in OpenAI's shape (a stream: an
error event, then [DONE]), hearing `: waiting` comments meanwhile; and a client that leaves
mid-upload ends its request quietly."""

from __future__ import annotations

import json
import logging
import socket
import time

import pytest

from kvlayout.errors import ConfigError
from kvlayout.server.config import ServerSection
from tests.server.conftest import serving
from tests.server.test_faults import open_stream, wait_for
from tests.server.test_monitor import SlowModel

TIMEOUT_S = 4.0  # past the app's QUEUED_KEEPALIVE_S (3 s): a queued stream hears one comment first


def read_stream(sock: socket.socket) -> bytes:
    seen = b""
    while b"data: [DONE]" not in seen:
        part = sock.recv(65536)
        if not part:
            break
        seen += part
    return seen


def test_a_request_queued_past_queue_timeout_s_is_answered_503_and_a_queued_stream_hears_waiting(tiny_loaded):
    config = {"server": {"max_sequences": 1, "queue_timeout_s": TIMEOUT_S, "max_tokens": 1000}}
    with serving(tiny_loaded, config, model=SlowModel(tiny_loaded[0], 0.03)) as live:
        first = open_stream(live, {"prompt": "a long first request", "max_tokens": 1000})  # ~30 s of steps
        try:
            queued = socket.create_connection(("127.0.0.1", live.port), timeout=30)
            raw = json.dumps({"model": "tiny", "stream": True, "prompt": "queued stream", "max_tokens": 5}).encode()
            queued.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                           + f"Content-Length: {len(raw)}\r\n\r\n".encode() + raw)
            t0 = time.monotonic()
            status, body, _ = live.post("/v1/completions", {"model": "tiny", "prompt": "queued", "max_tokens": 5})
            waited = time.monotonic() - t0
            assert status == 503 and TIMEOUT_S - 0.5 <= waited < TIMEOUT_S + 3
            assert body["error"]["code"] == "queue_timeout" and body["error"]["type"] == "server_error"
            assert "server.queue_timeout_s" in body["error"]["message"]
            seen = read_stream(queued).decode()
            queued.close()
            assert seen.startswith("HTTP/1.1 200")
            assert seen.index(": waiting\n\n") < seen.index("data: {")  # heard while queued, before the error
            events = [line[6:] for line in seen.splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]"
            error = json.loads(events[-2])["error"]
            assert error["code"] == "queue_timeout" and error["type"] == "server_error"
            assert not any("choices" in json.loads(e) for e in events[:-1])  # it never generated
            assert live.health()["requests"] == {"running": 1, "waiting": 0}  # the first goes on
        finally:
            first.close()
        wait_for(lambda: live.health()["requests"]["running"] == 0, "the first request cancelled")
        # A request that starts at once is untouched by the deadline.
        status, body, _ = live.post("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 3})
        assert status == 200 and body["usage"]["completion_tokens"] >= 1


def test_a_request_started_before_its_deadline_runs_past_it(tiny_loaded):
    config = {"server": {"max_sequences": 1, "queue_timeout_s": 0.5, "max_tokens": 100}}
    with serving(tiny_loaded, config, model=SlowModel(tiny_loaded[0], 0.02)) as live:
        t0 = time.monotonic()
        status, body, _ = live.post("/v1/completions", {"model": "tiny", "prompt": "go on", "max_tokens": 60})
        assert status == 200 and time.monotonic() - t0 > 0.5  # it ran longer than the queue deadline
        assert body["usage"]["completion_tokens"] >= 1


@pytest.mark.parametrize("bad", [0, -1, float("nan"), "5"])
def test_queue_timeout_s_must_be_a_positive_number(bad):
    with pytest.raises(ConfigError, match=r"server\.queue_timeout_s"):
        ServerSection(queue_timeout_s=bad)


class Records(logging.Handler):
    def __init__(self):
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


def test_a_client_leaving_mid_upload_logs_no_traceback(tiny_loaded, capfd):
    heard = Records()
    loggers = [logging.getLogger(name) for name in ("uvicorn.error", "uvicorn", "")]
    for logger in loggers:
        logger.addHandler(heard)
    try:
        with serving(tiny_loaded) as live:
            for _ in range(3):
                sock = socket.create_connection(("127.0.0.1", live.port), timeout=10)
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                             b"Content-Length: 1000\r\n\r\n{\"model\": \"tiny\", \"prom")
                time.sleep(0.3)  # the server is reading the body
                sock.close()
            time.sleep(0.5)
            status, _, _ = live.post("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2})
            assert status == 200
    finally:
        for logger in loggers:
            logger.removeHandler(heard)
    err = capfd.readouterr().err
    assert "Traceback" not in err and "ClientDisconnect" not in err
    assert not [r for r in heard.records if r.exc_info or "ClientDisconnect" in r.getMessage()]

