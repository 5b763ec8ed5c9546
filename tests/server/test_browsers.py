"""What a web page cannot make the server do: POST a body a browser sends without asking (a CORS
"simple request": text/plain, a form, a typeless blob), or reach it by DNS rebinding (its own
name, re-pointed at 127.0.0.1, arriving as the Host header)."""

from __future__ import annotations

import http.client
import json
import subprocess
import sys

import pytest

from tests.server.conftest import serving
from tests.server.test_cli import CONFIG, Process

BODY = json.dumps({"model": "tiny", "prompt": "hello", "max_tokens": 4}).encode()
CHAT = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}).encode()
REBIND = "rebind.attacker.example"


def ask(port: int, method: str, path: str, body: bytes | None = None, headers: dict | None = None):
    """(status, JSON answer or raw bytes) of one request to 127.0.0.1:`port`, `headers` exactly as given
    (a Host among them replaces http.client's own)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        conn.request(method, path, body, headers or {})
        resp = conn.getresponse()
        data = resp.read()
        try:
            return resp.status, json.loads(data)
        except ValueError:
            return resp.status, data
    finally:
        conn.close()


def generated(live) -> int:
    return ask(live.port, "GET", "/stats")[1]["generated_tokens"]


SIMPLE_REQUESTS = [  # what a page on any site may POST to any origin without a preflight
    {"Content-Type": "text/plain"},
    {"Content-Type": "text/plain;charset=UTF-8"},
    {"Content-Type": "application/x-www-form-urlencoded"},
    {"Content-Type": "multipart/form-data; boundary=x"},
    {},  # fetch() with a Blob of no type sends no Content-Type at all
    {"Content-Type": "application/jsonx"},
]


@pytest.mark.parametrize("headers", SIMPLE_REQUESTS, ids=lambda h: h.get("Content-Type", "none"))
@pytest.mark.parametrize("path, body", [("/v1/completions", BODY), ("/v1/chat/completions", CHAT)],
                         ids=["text", "chat"])
def test_a_body_not_sent_as_json_is_refused_415_and_generates_nothing(live, headers, path, body):
    before, health = generated(live), live.health()
    status, answer = ask(live.port, "POST", path, body, headers)
    assert status == 415, answer
    assert set(answer["error"]) == {"message", "type", "param", "code"}
    assert answer["error"]["code"] == "unsupported_media_type"
    assert "application/json" in answer["error"]["message"]
    assert generated(live) == before and live.health() == health


@pytest.mark.parametrize("kind", ["application/json", "application/json; charset=utf-8", "Application/JSON"])
def test_a_json_body_is_served_under_its_content_type_with_or_without_a_charset(live, kind):
    before = generated(live)
    status, answer = ask(live.port, "POST", "/v1/completions", BODY, {"Content-Type": kind})
    assert status == 200, answer
    assert answer["usage"]["completion_tokens"] >= 1
    assert generated(live) == before + answer["usage"]["completion_tokens"]


ROUTES = [("GET", "/stats", None), ("GET", "/health", None), ("GET", "/", None), ("GET", "/v1/models", None),
          ("GET", "/metrics", None), ("GET", "/cells/at?cell=0", None), ("POST", "/v1/completions", BODY),
          ("POST", "/v1/chat/completions", CHAT)]


@pytest.mark.parametrize("method, path, body", ROUTES, ids=[r[1] for r in ROUTES])
@pytest.mark.parametrize("host", [REBIND, f"{REBIND}:8080", "127.0.0.1.attacker.example", "0.0.0.0"])
def test_a_host_that_is_not_the_servers_is_refused_403_everywhere(live, method, path, body, host):
    before, health = generated(live), live.health()
    headers = {"Host": host, "Content-Type": "application/json"}
    status, answer = ask(live.port, method, path, body, headers)
    assert status == 403, answer
    error = answer["error"]
    assert error["code"] == "host_not_allowed" and error["type"] == "invalid_request_error"
    assert repr(host) in error["message"] and "--allowed-host" in error["message"]
    assert generated(live) == before and live.health() == health


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.1:{port}", "localhost", "LOCALHOST:{port}", "[::1]:{port}",
                                  "localhost.:{port}"])
def test_the_servers_own_loopback_names_are_let_in_with_or_without_a_port(live, host):
    status, answer = ask(live.port, "GET", "/health", None, {"Host": host.format(port=live.port)})
    assert status == 200 and answer["status"] == "ok"


def test_the_official_client_and_a_plain_connection_pass_the_host_check(live):
    completion = live.client().completions.create(model=live.model, prompt="hi", max_tokens=2)
    assert completion.usage.completion_tokens >= 1
    assert live.get("/health")[0] == 200  # http.client's own Host: 127.0.0.1:PORT


def test_an_allowed_host_is_let_in_and_others_still_are_not(tiny_loaded):
    with serving(tiny_loaded, {"server": {"allowed_hosts": ["kv.example.org", "10.1.2.3"]}}) as live:
        for host in ("kv.example.org", "KV.example.org:8080", "10.1.2.3:80", "localhost"):
            status, answer = ask(live.port, "POST", "/v1/completions", BODY,
                                 {"Host": host, "Content-Type": "application/json"})
            assert status == 200 and answer["usage"]["completion_tokens"] >= 1, (host, answer)
        for host in (REBIND, "example.org", "kv.example.org.attacker.example"):
            assert ask(live.port, "GET", "/stats", None, {"Host": host})[0] == 403


def test_allowed_host_from_the_command_line_reaches_the_server(tmp_path):
    config = tmp_path / "serve.toml"
    config.write_text(CONFIG.format(grace=1))
    server = Process([str(config), "--port", "0", "--allowed-host", "kv.example.org", "--allowed-host", "kv2.example"],
                     tmp_path)
    try:
        port = int(server.ready().rsplit(":", 1)[1])
        for host in ("kv.example.org", "kv2.example:1234", "127.0.0.1"):
            status, answer = ask(port, "GET", "/health", None, {"Host": host})
            assert status == 200 and answer["status"] == "ok", (host, answer)
        status, answer = ask(port, "GET", "/stats", None, {"Host": REBIND})
        assert status == 403 and "--allowed-host rebind.attacker.example" in answer["error"]["message"]
    finally:
        server.kill()


@pytest.mark.parametrize("name", ["kv.example.org:8080", "http://kv.example.org", "a b", ""])
def test_an_allowed_host_that_is_no_host_name_is_one_line_exit_2(tmp_path, name):
    done = subprocess.run([sys.executable, "-m", "kvlayout.cli", "serve", "--port", "0", "--allowed-host", name],
                          cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0 and "--allowed-host" in done.stderr and "Traceback" not in done.stderr


def test_allowed_hosts_in_the_config_must_be_a_list_of_names():
    from kvlayout.errors import ConfigError
    from kvlayout.server.config import ServeConfig

    assert ServeConfig.from_mapping({"server": {"allowed_hosts": ["a.example", "[::1]"]}}).server.allowed_hosts == (
        "a.example", "[::1]")
    for bad in ("a.example", ["a.example:80"], [1], ["x/y"]):
        with pytest.raises(ConfigError, match="server.allowed_hosts"):
            ServeConfig.from_mapping({"server": {"allowed_hosts": bad}})
