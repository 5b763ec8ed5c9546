"""`kvlayout serve` stopped while it works: every client is answered in OpenAI's shape, none is cut off.

A real server process (tests.server.test_cli's `Process`) with two requests
generating (one streamed, one not) and two waiting behind them
(`max_sequences = 2`), then SIGTERM: the waiting ones are answered at once
(503, or an error event and [DONE]), the generating ones get the grace period
and are then answered the same way, and the process exits 0 without a traceback.
The clients are raw sockets, so what is checked is the bytes the server sent.
"""

from __future__ import annotations

import json
import signal
import socket
import threading
import time

from tests.server.test_cli import Process

GRACE_S = 3.0
# The tiny preset's greedy answer to "0" runs 3,559 tokens (several seconds on two cores, two at a
# time), so the generating requests are still generating when the grace period ends.
LONG = {"model": "tiny", "prompt": "0", "max_tokens": 4000}
CONFIG = f"""\
[model]
preset = "tiny"
[sampling]
temperature = 0
[cache]
capacity = 16384
max_seqs = 8
[server]
max_sequences = 2
max_tokens = 4000
shutdown_grace_s = {GRACE_S}
"""


class Client:
    """One request on its own socket, read to the end on a thread: when each byte came, and all of them."""

    def __init__(self, port: int, body: dict):
        raw = json.dumps(body).encode()
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=60)
        self.sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                          + f"Content-Length: {len(raw)}\r\nConnection: close\r\n\r\n".encode() + raw)
        self.data, self.first_at, self.ended_at = b"", None, None
        self.thread = threading.Thread(target=self.read, daemon=True)
        self.thread.start()

    def read(self) -> None:
        while part := self.sock.recv(65536):
            self.first_at = self.first_at or time.monotonic()
            self.data += part
        self.ended_at = time.monotonic()

    def wait(self, timeout: float) -> None:
        self.thread.join(timeout)
        assert self.ended_at is not None, f"never closed; so far: {self.data[-300:]!r}"

    @property
    def status(self) -> int:
        return int(self.data.split(b" ", 2)[1])

    @property
    def body(self) -> bytes:
        return self.data.split(b"\r\n\r\n", 1)[1]

    def events(self) -> list[str]:
        """A stream's `data:` payloads, in order (the body is chunked; events never span a chunk here,
        but the chunk sizes are dropped by keeping only the data lines)."""
        return [line[len("data: "):] for line in self.body.decode().splitlines() if line.startswith("data: ")]


def assert_shutdown_error(error: dict) -> None:
    assert set(error) == {"error"}, error
    assert error["error"]["type"] == "server_error" and error["error"]["code"] == "server_shutting_down", error
    assert "shutting down" in error["error"]["message"], error


def assert_stream_ended_by_shutdown(client: Client) -> None:
    assert client.status == 200, client.data[:300]
    events = client.events()
    assert events[-1] == "[DONE]", events[-3:]
    assert_shutdown_error(json.loads(events[-2]))
    # Nothing said it had finished: no finish_reason before the error.
    assert all(c["finish_reason"] is None for e in events[:-2] for c in json.loads(e)["choices"]), events[-4:]


def assert_answered_503(client: Client) -> None:
    assert client.status == 503, client.data[:300]
    assert b"content-type: application/json" in client.data.lower()
    assert_shutdown_error(json.loads(client.body))


def test_a_stop_answers_the_queue_at_once_and_the_running_after_the_grace_in_openais_shape(tmp_path):
    path = tmp_path / "serve.toml"
    path.write_text(CONFIG)
    server = Process([str(path), "--port", "0"], tmp_path)
    port = int(server.ready().rsplit(":", 1)[1])
    try:
        running_stream = Client(port, {**LONG, "stream": True})
        running_whole = Client(port, LONG)
        deadline = time.monotonic() + 30
        while running_stream.first_at is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert running_stream.first_at is not None, "the stream never started"
        time.sleep(0.3)  # the whole one is generating too (both fit max_sequences)
        queued_stream = Client(port, {**LONG, "stream": True})
        queued_whole = Client(port, LONG)
        time.sleep(0.5)  # both taken and waiting: the stream's head and nothing more
        assert b"data: " not in queued_stream.data and queued_whole.data == b""
        signalled = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)

        for client in (queued_stream, queued_whole):
            client.wait(timeout=GRACE_S + 30)
            assert client.ended_at - signalled < GRACE_S / 2, "a queued request waited for the grace period"
        assert_stream_ended_by_shutdown(queued_stream)
        assert_answered_503(queued_whole)

        for client in (running_stream, running_whole):
            client.wait(timeout=GRACE_S + 30)
            # They had the grace period to finish, then were answered, not cut off.
            assert GRACE_S - 0.2 <= client.ended_at - signalled < GRACE_S + 5
        assert_stream_ended_by_shutdown(running_stream)
        assert len(running_stream.events()) > 10  # it had been generating
        assert_answered_503(running_whole)

        code, said = server.finish(timeout=GRACE_S + 15)
    finally:
        if server.proc.poll() is None:
            server.kill()
    assert code == 0, said
    assert time.monotonic() - signalled < GRACE_S + 10
    assert "Traceback" not in said and "CancelledError" not in said, said
