"""What clients cannot break: disconnects, a full queue, malformed bodies, a forward that fails."""

from __future__ import annotations

import concurrent.futures
import json
import socket
import time

import pytest

from tests.runner.conftest import oracle_greedy
from tests.runner.flaky import FlakyModel
from tests.server.conftest import serving

LONG = 200  # tokens a request may generate: far more than a test waits for


def wait_for(predicate, what: str, bound_s: float = 10.0):
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(f"not within {bound_s} s: {what}")


def open_stream(live, body: dict) -> socket.socket:
    """A raw streaming request whose first event has arrived; the caller closes it whenever."""
    sock = socket.create_connection(("127.0.0.1", live.port), timeout=30)
    raw = json.dumps({"model": "tiny", "stream": True, **body}).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                 + f"Content-Length: {len(raw)}\r\n\r\n".encode() + raw)
    seen = b""
    while b"data: " not in seen:
        seen += sock.recv(4096)
    return sock


def test_a_client_that_disconnects_mid_stream_has_its_cells_freed(tiny_loaded):
    with serving(tiny_loaded) as live:
        assert live.health()["cells"]["used"] == 0
        prompt = "a prompt of some length " * 8  # 192 tokens of the byte tokenizer
        sock = open_stream(live, {"prompt": prompt, "max_tokens": LONG})
        # The first token's event can come before the snapshot of its step: wait for it.
        running = wait_for(lambda: (h := live.health())["cells"]["used"] > len(prompt) and h, "the prompt in")
        assert running["requests"]["running"] == 1
        sock.close()
        after = wait_for(lambda: (h := live.health())["requests"]["running"] == 0 and h, "the request cancelled")
        # What it generated is freed; its prompt stays as a kept prefix, and nothing else does.
        assert after["cells"]["used"] == len(prompt)
        assert (after["prefix_cache"]["entries"], after["prefix_cache"]["tokens"]) == (1, len(prompt))
        assert after["generated_tokens"] < LONG
        # The server goes on serving.
        status, body, _ = live.post("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 3})
        assert status == 200 and body["choices"][0]["finish_reason"] in ("stop", "length")


def test_a_full_queue_answers_429_with_retry_after_and_nothing_else_changes(tiny_loaded):
    with serving(tiny_loaded, {"server": {"max_sequences": 1, "queue": 1}}) as live:
        first = open_stream(live, {"prompt": "one", "max_tokens": LONG})
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            queued = pool.submit(live.post, "/v1/completions", {"model": "tiny", "prompt": "two", "max_tokens": 2})
            wait_for(lambda: live.health()["requests"]["waiting"] == 1, "the second request queued")
            status, body, headers = live.post("/v1/completions", {"model": "tiny", "prompt": "three", "max_tokens": 2})
            assert status == 429 and int(headers["retry-after"]) >= 1
            assert body["error"]["type"] == "rate_limit_error" and "server.queue=1" in body["error"]["message"]
            assert live.health()["requests"] == {"running": 1, "waiting": 1}
            first.close()  # the queued request runs once the first is cancelled
            status, body, _ = queued.result(timeout=30)
        assert status == 200 and body["usage"]["completion_tokens"] >= 1


BAD_BODIES = [
    (b"", 400), (b"{", 400), (b"[1, 2]", 400), (b"null", 400), (b'"text"', 400),
    (b'{"model": "tiny", "prompt": NaN}', 400), (b'{"model": "tiny", "prompt": "x", "max_tokens": 1e400}', 400),
    (b"[" * 100_000 + b"]" * 100_000, 400), (b"\xff\xfe{}", 400), (b'{"model": "tiny", "prompt": "\\ud800"}', 400),
    (b'{"model": "tiny", "prompt": "x", "max_tokens": 99999999999999999999999}', 400),
    (b'{"model": "tiny", "prompt": "x", "n": 1, "n": 99}', 400),  # the last of a repeated key counts, as in JSON.parse
    (b'{"model": "tiny", "prompt": "x", "stop": {"a": 1}}', 400), (b'{"model": "tiny", "prompt": "x"}' * 2, 400),
    (b'{"model": "tiny", "prompt": "x", "temperature": 1' + b"0" * 400 + b"}", 400),  # math.isfinite overflows
    (b'{"model": "tiny", "prompt": "x", "top_p": -1' + b"0" * 400 + b"}", 400),
    # A lone surrogate echoed in the message (the body shown, a field's value shown, an unknown field's name).
    (b'"\\ud800"', 400), (b'{"model": "tiny", "prompt": "x", "stop": ["\\ud800", 1]}', 400),
    (b'{"model": "tiny", "\\udfff": 1}', 400),
]


@pytest.mark.parametrize("raw, status", BAD_BODIES, ids=[f"body{i}" for i in range(len(BAD_BODIES))])
def test_a_malformed_body_is_answered_in_openai_shape_and_the_server_keeps_serving(live, raw, status):
    before = live.health()
    code, body, _ = live.post("/v1/completions", raw[:2_000_000])
    assert code == status, body
    if status != 200:
        assert set(body["error"]) == {"message", "type", "param", "code"}
    assert live.health() == before  # refused: nothing of the server changed (cells, steps, kept prefixes)


def test_a_lone_surrogate_a_message_echoes_comes_back_as_the_escape_it_came_as(live):
    code, body, _ = live.post("/v1/completions", b'{"model": "tiny", "prompt": "x", "\\ud800": 1}')
    assert code == 400 and body["error"]["message"].endswith(": \ud800") and body["error"]["param"] == "\ud800"


def test_an_oversized_body_answers_413_declared_or_not(tiny_loaded):
    with serving(tiny_loaded, {"server": {"max_body_bytes": 1000}}) as live:
        big = json.dumps({"model": "tiny", "prompt": "x" * 2000}).encode()
        status, body, _ = live.post("/v1/completions", big)
        assert status == 413 and "server.max_body_bytes" in body["error"]["message"]
        # Chunked, with no length declared: read up to the limit, no further.
        conn = live.connection()
        conn.putrequest("POST", "/v1/completions")
        conn.putheader("Transfer-Encoding", "chunked")
        conn.putheader("Content-Type", "application/json")
        conn.endheaders()
        for i in range(0, len(big), 500):
            part = big[i : i + 500]
            conn.send(f"{len(part):x}\r\n".encode() + part + b"\r\n")
        conn.send(b"0\r\n\r\n")
        assert conn.getresponse().status == 413
        conn.close()


def test_unknown_routes_and_methods_answer_in_openai_shape(live):
    status, body = live.get("/v1/nothing")
    assert status == 404 and "/v1/nothing" in body["error"]["message"]
    status, body = live.get("/v1/completions")
    assert status == 405 and body["error"]["type"] == "invalid_request_error"


def test_a_forward_that_keeps_failing_fails_only_its_request(tiny_loaded):
    model = tiny_loaded[0]
    body = {"model": "tiny", "max_tokens": 6}
    with serving(tiny_loaded) as live:
        expected = [
            live.post("/v1/completions", {**body, "prompt": p})[1]["choices"][0]["text"] for p in ("abc", "xyz")
        ]
    flaky = FlakyModel(model, 1, poison=True)  # every forward carrying "~" fails, after layer 0 wrote K/V
    with serving(tiny_loaded, model=flaky) as live:
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            got = list(pool.map(lambda p: live.post("/v1/completions", {**body, "prompt": p}), ("abc", "a~b", "xyz")))
        assert got[1][0] == 500 and got[1][1]["error"]["type"] == "server_error"
        assert [got[0][1]["choices"][0]["text"], got[2][1]["choices"][0]["text"]] == expected
        h = live.health()
        # The engine retried and failed only that request (no step raised out of it); every cell freed:
        # the prompts and answers are shorter than a block, so none is kept.
        assert h["status"] == "ok" and h["failed_steps"] == 0 and h["cells"]["used"] == 0


def test_a_step_that_raises_fails_what_ran_and_the_waiting_request_runs_on_the_fresh_engine(tiny_loaded):
    model, _, tok, _ = tiny_loaded
    with serving(tiny_loaded, {"server": {"max_sequences": 1, "queue": 2}}) as live:
        worker = live.service.worker
        first = open_stream(live, {"prompt": "one", "max_tokens": LONG})
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            queued = pool.submit(live.post, "/v1/completions", {"model": "tiny", "prompt": "Q: two?", "max_tokens": 6})
            wait_for(lambda: live.health()["requests"] == {"running": 1, "waiting": 1}, "the second request queued")
            engine = worker.engine

            def boom():  # the next step raises out of the engine (not a forward the engine retries)
                raise RuntimeError("a broken step")

            engine.step = boom
            status, body, _ = queued.result(timeout=30)
        said = b""
        while chunk := first.recv(65536):  # the first stream ends, saying why
            said += chunk
        first.close()
        assert b"the step failed (RuntimeError: a broken step)" in said
        assert worker.engine is not engine and live.health()["failed_steps"] == 1
        ids, _ = oracle_greedy(model, tok.encode("Q: two?"), 6, frozenset(tok.eos_ids))
        assert status == 200 and body["choices"][0]["text"] == tok.decode(ids)
        wait_for(lambda: live.health()["requests"] == {"running": 0, "waiting": 0}, "both requests over")


def test_the_seq_layout_serves_one_sequence_at_a_time_and_cancels_too(tiny_loaded):
    model, _, tok, _ = tiny_loaded
    with serving(tiny_loaded, {"layout": {"backend": "mlx", "kind": "seq"}, "server": {"max_sequences": 4}}) as live:
        assert live.health()["prefix_cache"] is None  # reuse needs a cell layout
        sock = open_stream(live, {"prompt": "abc", "max_tokens": LONG})
        sock.close()
        wait_for(lambda: live.health()["requests"]["running"] == 0, "the request cancelled")
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            got = list(pool.map(lambda p: live.post("/v1/completions", {"model": "tiny", "prompt": p, "max_tokens": 6}),
                                ("Q: one?", "Q: two?")))
    for (status, body, _), p in zip(got, ("Q: one?", "Q: two?")):
        ids, _ = oracle_greedy(model, tok.encode(p), 6, frozenset(tok.eos_ids))
        assert status == 200 and body["choices"][0]["text"] == tok.decode(ids)
