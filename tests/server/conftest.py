"""A live server for the tests: in this process, on 127.0.0.1 and a free port, bounded.

Each server stops itself: after `LIFETIME_S` seconds or `MAX_REQUESTS`
requests (uvicorn's limit_max_requests), whichever comes first, and at the
end of its `with` block. The tiny preset is loaded once per session.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import threading
from collections.abc import Iterator
from typing import Any

import attrs
import openai
import pytest

from kvlayout.runner.config import ModelSection
from kvlayout.runner.job import load_model_for
from kvlayout.server.config import ServeConfig
from kvlayout.server.serve import Server, bind, http_config
from kvlayout.server.service import Service, prepare_service

LIFETIME_S = 120
MAX_REQUESTS = 400
# Greedy by default ([sampling] temperature 0): the tests' oracles are greedy runs. The server's own default
# (the model's generation_config.json, else OpenAI's 1.0) is tested by tests/server/test_sampling_defaults.py.
TINY = {"model": {"preset": "tiny"}, "cache": {"capacity": 4096, "max_seqs": 16}, "sampling": {"temperature": 0},
        "server": {"max_sequences": 16, "max_tokens": 256}, "engine": {"prefill_chunk": 64}}


@attrs.define
class Live:
    service: Service
    url: str

    @property
    def model(self) -> str:
        return self.service.model_id

    def client(self, **kw: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="unused", max_retries=0, timeout=60, **kw)

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def connection(self, timeout: float = 60) -> http.client.HTTPConnection:
        return http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)

    def post(self, path: str, body: bytes | str | dict, headers: dict | None = None) -> tuple[int, dict, dict]:
        """(status, JSON answer, headers) of one POST; `body` a dict is sent as JSON, else as it is."""
        raw = json.dumps(body).encode() if isinstance(body, dict) else body
        conn = self.connection()
        try:
            conn.request("POST", path, raw, {"Content-Type": "application/json", **(headers or {})})
            resp = conn.getresponse()
            data = resp.read()
            return resp.status, json.loads(data) if data else {}, {k.lower(): v for k, v in resp.getheaders()}
        finally:
            conn.close()

    def get(self, path: str) -> tuple[int, dict]:
        conn = self.connection()
        try:
            conn.request("GET", path)
            resp = conn.getresponse()
            return resp.status, json.loads(resp.read())
        finally:
            conn.close()

    def health(self) -> dict:
        status, body = self.get("/health")
        assert status == 200
        return body


@pytest.fixture(scope="session")
def tiny_loaded():
    return load_model_for(ServeConfig(model=ModelSection(preset="tiny")))


def merged(base: dict, extra: dict) -> dict:
    out = {k: dict(v) for k, v in base.items()}
    for k, v in extra.items():
        if k == "model":  # a model is named one way: the section is replaced whole
            out[k] = dict(v)
        else:
            out.setdefault(k, {}).update(v)
    return out


@contextlib.contextmanager
def serving(loaded, config: dict | None = None, model=None) -> Iterator[Live]:
    """A server on `config` (merged over TINY) with `loaded`'s model (or `model` in its place);
    `loaded` None: the config's model, loaded by the server."""
    cfg = ServeConfig.from_mapping(merged(TINY, config or {}), source="test")
    if model is not None:
        loaded = (model, *loaded[1:])
    timeout = 30 if loaded is not None else 120
    # The engine's own thread prepares the service (the cache is made where it is used), then runs it.
    prepared: dict[str, Any] = {}
    made = threading.Event()

    def engine() -> None:
        try:
            prepared["service"] = prepare_service(cfg, loaded)
        finally:
            made.set()
        prepared["service"].worker.run()

    engine_thread = threading.Thread(target=engine, daemon=True)
    engine_thread.start()
    assert made.wait(timeout) and "service" in prepared, "the service was not prepared"
    service = prepared["service"]
    sock = bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    ready = threading.Event()
    config = http_config(service, timeout_graceful_shutdown=2, limit_max_requests=MAX_REQUESTS)
    server = Server(config, ready.set)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    watchdog = threading.Timer(LIFETIME_S, lambda: setattr(server, "should_exit", True))
    watchdog.start()
    try:
        assert ready.wait(30), "the test server did not start"
        yield Live(service, f"http://127.0.0.1:{port}")
    finally:
        watchdog.cancel()
        server.should_exit = True
        thread.join(20)
        service.worker.stop()
        engine_thread.join(20)
        service.close()
        assert not thread.is_alive() and not engine_thread.is_alive(), "the test server did not stop"


@pytest.fixture(scope="module")
def live(tiny_loaded) -> Iterator[Live]:
    with serving(tiny_loaded) as server:
        yield server
