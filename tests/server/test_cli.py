"""`kvlayout serve` as a user starts it: a process on 127.0.0.1, stopped by a signal, exit 0.

Each server is its own process on a free port (`--port 0`; the ready line
says which), stopped by the test and killed if it outlives its bound.
"""

from __future__ import annotations

import json
import os
import re
import resource
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

CONFIG = """\
[model]
preset = "tiny"
[cache]
capacity = 2048
max_seqs = 8
[server]
max_sequences = 8
shutdown_grace_s = {grace}
"""
BOUND_S = 60


class Process:
    def __init__(self, args: list[str], cwd, **popen):
        self.proc = subprocess.Popen([sys.executable, "-m", "kvlayout.cli", "serve", *args], cwd=cwd,
                                     stderr=subprocess.PIPE, text=True, env={**os.environ, "COLUMNS": "200"}, **popen)
        self.lines: list[str] = []

    def ready(self) -> str:
        """The URL the ready line names; AssertionError with what it said when it dies first."""
        deadline = time.monotonic() + BOUND_S
        while time.monotonic() < deadline:
            line = self.proc.stderr.readline()
            if not line:
                break
            self.lines.append(line)
            if m := re.search(r"serving \S+ on (http://\S+)", line):
                return m.group(1)
        self.kill()
        raise AssertionError("never ready: " + "".join(self.lines))

    def finish(self, timeout: float = BOUND_S) -> tuple[int, str]:
        try:
            _, rest = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            self.kill()
            raise AssertionError("the server outlived its bound") from exc
        return self.proc.returncode, "".join(self.lines) + rest

    def kill(self) -> None:
        self.proc.kill()
        self.proc.communicate()


def post(url: str, body: dict, timeout: float = 30) -> dict:
    req = urllib.request.Request(
        f"{url}/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def first_event(url: str, request: bytes) -> socket.socket:
    """A raw HTTP `request` to the server at `url` whose stream's first event has arrived; left open."""
    sock = socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=30)
    sock.sendall(request)
    seen = b""
    while b"data: " not in seen:
        seen += sock.recv(65536)
    return sock


@pytest.fixture
def config(tmp_path):
    def write(grace: float = 5) -> str:
        path = tmp_path / "serve.toml"
        path.write_text(CONFIG.format(grace=grace))
        return str(path)
    return write


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_signal_ends_the_server_with_exit_0(config, tmp_path, sig):
    server = Process([config(), "--port", "0"], tmp_path)
    url = server.ready()
    assert url.startswith("http://127.0.0.1:")
    answer = post(url, {"model": "tiny", "prompt": "hello", "max_tokens": 3})
    assert answer["usage"]["completion_tokens"] >= 1
    server.proc.send_signal(sig)
    code, said = server.finish()
    assert code == 0, said
    assert "Traceback" not in said


def test_in_flight_requests_are_finished_or_cancelled_within_the_grace_period(config, tmp_path):
    server = Process([config(grace=1), "--port", "0"], tmp_path)
    url = server.ready()
    raw = json.dumps({"model": "tiny", "prompt": "go on", "max_tokens": 1000, "stream": True}).encode()
    sock = first_event(url, b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                       + f"Content-Length: {len(raw)}\r\n\r\n".encode() + raw)
    started = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    code, said = server.finish()
    assert code == 0, said
    assert time.monotonic() - started < 1 + 10  # the grace period, then the cancel
    sock.close()


def test_a_second_ctrl_c_at_once_skips_the_grace_and_still_says_no_traceback(config, tmp_path):
    server = Process([config(grace=20), "--port", "0"], tmp_path)
    server.ready()
    server.proc.send_signal(signal.SIGINT)
    server.proc.send_signal(signal.SIGINT)  # as a terminal's Ctrl-C reaching both a wrapper and the server does
    code, said = server.finish()
    assert code == 0 and "Traceback" not in said and "CancelledError" not in said, said


def test_a_burst_of_stop_signals_still_ends_the_server_with_exit_0(config, tmp_path):
    # The handler runs on the engine's thread between any two bytecodes, itself included: one that
    # took a lock (Event.set) deadlocked when the next signal landed inside it.
    server = Process([config(grace=1), "--port", "0"], tmp_path)
    server.ready()
    for _ in range(400):  # spaced, so some land while the handler of the one before runs
        server.proc.send_signal(signal.SIGTERM)
        time.sleep(0.0002)
    code, said = server.finish(timeout=30)
    assert code == 0 and "Traceback" not in said, said


def test_an_open_cell_map_stream_does_not_hold_the_shutdown_for_the_grace_period(config, tmp_path):
    server = Process([config(grace=20), "--port", "0"], tmp_path)
    url = server.ready()
    sock = first_event(url, b"GET /cells HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
    started = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    code, said = server.finish()
    assert code == 0, said
    assert time.monotonic() - started < 10  # well within the 20 s grace: the map's stream ended at once
    sock.close()


def test_a_port_in_use_is_one_line_and_exit_2(config, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = Process([config(), "--port", str(port)], tmp_path)
        code, said = server.finish()
    assert code == 2
    assert said.strip().splitlines()[-1].startswith(f"kvlayout: error: cannot listen on 127.0.0.1:{port}")
    assert "Traceback" not in said


@pytest.mark.parametrize(
    "args, words",
    [
        (["--port", "70000"], "--port 70000"),
        (["--host", "no.such.host.invalid", "--port", "0"], "--host 'no.such.host.invalid'"),
        (["--layout", "mlx:nope", "--port", "0"], "mlx:nope"),
    ],
)
def test_a_bad_flag_is_one_line_and_exit_2(config, tmp_path, args, words):
    code, said = Process([config(), *args], tmp_path).finish()
    assert code == 2 and words in said and "Traceback" not in said
    assert len(said.strip().splitlines()) == 1


def test_a_bad_server_section_is_one_line_naming_the_key(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text('[model]\npreset = "tiny"\n[server]\nqueue = -1\n')
    code, said = Process([str(path), "--port", "0"], tmp_path).finish()
    assert code == 2 and "server.queue" in said and len(said.strip().splitlines()) == 1
    path.write_text('[model]\npreset = "tiny"\n[[requests]]\nprompt = "x"\n')
    code, said = Process([str(path), "--port", "0"], tmp_path).finish()
    assert code == 2 and "requests" in said and len(said.strip().splitlines()) == 1


@pytest.mark.parametrize("line, key", [
    ("header_timeout_s = 0", "server.header_timeout_s"), ("idle_timeout_s = -1", "server.idle_timeout_s"),
    ('idle_timeout_s = "30"', "server.idle_timeout_s"), ("max_connections = 0", "server.max_connections"),
    ("max_connections = 2.5", "server.max_connections"),
])
def test_a_bad_connection_limit_is_one_line_naming_the_key(tmp_path, line, key):
    path = tmp_path / "bad.toml"
    path.write_text(f'[model]\npreset = "tiny"\n[server]\n{line}\n')
    code, said = Process([str(path), "--port", "0"], tmp_path).finish()
    assert code == 2 and key in said and "Traceback" not in said and len(said.strip().splitlines()) == 1


def test_idle_sockets_past_the_descriptor_limit_neither_hang_a_request_nor_flood_stderr(config, tmp_path):
    """The probe's case: more idle connections than the process may open descriptors. The cap (lowered to
    what the limit leaves) answers the surplus 503 instead of failing accepts; the idle ones go after the
    header timeout, and a request is served."""
    path = tmp_path / "serve.toml"
    path.write_text(CONFIG.format(grace=1) + "header_timeout_s = 5\n")
    limit = 128
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    server = Process([str(path), "--port", "0"], tmp_path,
                     preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard)))
    url = server.ready()
    port = int(url.rsplit(":", 1)[1])
    idle = [socket.create_connection(("127.0.0.1", port), timeout=30) for _ in range(limit)]
    try:
        time.sleep(2)  # the surplus refused and closed (within 1 s each); the first ones held, idle
        with pytest.raises(urllib.error.HTTPError) as refused:  # answered at once, not left hanging
            post(url, {"model": "tiny", "prompt": "hi", "max_tokens": 2}, timeout=10)
        assert refused.value.code == 503
        assert "server.max_connections" in json.loads(refused.value.read())["error"]["message"]
        for sock in idle:  # each closed: by the header timeout, or refused
            sock.settimeout(15)
            try:
                while sock.recv(65536):
                    pass
            except ConnectionResetError:  # refused past the refusals the server holds: closed at once
                pass
    finally:
        for sock in idle:
            sock.close()
    assert post(url, {"model": "tiny", "prompt": "hi", "max_tokens": 2})["usage"]["completion_tokens"] >= 1
    server.proc.send_signal(signal.SIGTERM)
    code, said = server.finish()
    assert code == 0 and "Traceback" not in said, said
    assert "capping connections at" in said and said.count("Too many open files") <= 2, said
    assert said.count("refused a connection") <= 2, said  # one line per interval, however many were refused
