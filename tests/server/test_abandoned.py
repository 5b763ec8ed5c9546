"""A whole-answer (not streamed) request whose client leaves is cancelled as soon as it leaves, as a stream is."""

from __future__ import annotations

import json
import socket
import time

from tests.server.conftest import serving
from tests.server.test_faults import wait_for
from tests.server.test_monitor import SlowModel


def test_a_whole_answer_request_whose_client_left_is_cancelled_within_a_few_steps(tiny_loaded):
    # A token every ~20 ms: far faster than any "no token for a while, then check" poll would notice.
    many = 1000
    config = {"server": {"max_tokens": many}}
    with serving(tiny_loaded, config, model=SlowModel(tiny_loaded[0], 0.02)) as live:
        sock = socket.create_connection(("127.0.0.1", live.port), timeout=30)
        raw = json.dumps({"model": "tiny", "prompt": "a whole answer, never read", "max_tokens": many}).encode()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(raw)}\r\n\r\n".encode() + raw)
        wait_for(lambda: live.get("/stats")[1]["generated_tokens"] > 0, "the request generating")
        time.sleep(0.5)
        assert live.health()["requests"]["running"] == 1  # still going when its client leaves
        sock.close()
        left = time.monotonic()
        after = wait_for(lambda: (h := live.health())["requests"]["running"] == 0 and h, "the request cancelled", 2.0)
        assert time.monotonic() - left < 2.0
        time.sleep(0.5)  # ~25 more steps, had it gone on
        stats = live.get("/stats")[1]
        assert stats["generated_tokens"] == after["generated_tokens"] < many // 4
        assert stats["queue"] == {"running": 0, "waiting": 0}
        # The server goes on serving.
        status, body, _ = live.post("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 3})
        assert status == 200 and body["usage"]["completion_tokens"] >= 1
