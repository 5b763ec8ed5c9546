"""Issue 31's small gaps, against a live server through the official `openai` client (tiny preset):
`GET /v1/models/{id}`, a message's `name`, OpenAI's fields that change no output (accepted, checked,
ignored), an opt-in CORS origin, and the access log's one line per request.

The oracle for "ignored" is the same request without the field: greedy (temperature 0), so the
text must be the same token for token.
"""

from __future__ import annotations

import logging
import re
import subprocess
import sys
import time
from collections.abc import Iterator

import openai
import pytest

from kvlayout.cli import make_parser, serve_config
from kvlayout.errors import ConfigError
from kvlayout.server.app import ACCESS_LOG
from kvlayout.server.config import ServeConfig
from tests.server.conftest import TINY, Live, serving

ORIGIN = "http://app.example:5173"
MESSAGES = [{"role": "system", "content": "Answer in one line."}, {"role": "user", "content": "Q: a cell?\nA:"},
            {"role": "assistant", "content": "A slot."}, {"role": "user", "content": "Q: and a page?\nA:"}]
ASK = {"model": "tiny", "messages": MESSAGES, "max_tokens": 6, "temperature": 0}
ACCESS = re.compile(r"kvlayout: (\S+) (\S+) (\d{3}|-)(?: prompt_tokens=(\d+) completion_tokens=(\d+))? (\d+\.\d) ms")


class Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def wait_for(self, pattern: str, since: int, timeout: float = 5.0) -> re.Match:
        """The first access line from the `since`-th on matching `pattern`: it is written as the answer's
        last byte goes out, so a client can read the answer a moment before it is there."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.lines[since:]:
                m = ACCESS.fullmatch(line)
                if m and re.fullmatch(pattern, f"{m[1]} {m[2]} {m[3]}"):
                    return m
            time.sleep(0.01)
        raise AssertionError(f"no access line {pattern!r} in {self.lines}")


@pytest.fixture(scope="module")
def logged() -> Iterator[Lines]:
    access, lines = logging.getLogger(ACCESS_LOG), Lines()
    access.addHandler(lines)
    access.setLevel(logging.INFO)
    try:
        yield lines
    finally:
        access.removeHandler(lines)
        access.setLevel(logging.NOTSET)


@pytest.fixture(scope="module")
def server(tiny_loaded, logged) -> Iterator[Live]:
    with serving(tiny_loaded, {"server": {"cors_origins": [ORIGIN]}}) as live:
        yield live


@pytest.fixture(scope="module")
def plain(server) -> str:
    """The answer to ASK with no extra field."""
    return server.client().chat.completions.create(**ASK).choices[0].message.content


def request(live: Live, method: str, path: str, headers: dict) -> tuple[int, dict]:
    conn = live.connection()
    try:
        conn.request(method, path, headers=headers)
        resp = conn.getresponse()
        resp.read()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}
    finally:
        conn.close()


# -- GET /v1/models/{id}


def test_retrieving_the_served_model_gives_the_object_the_list_holds(server):
    client = server.client()
    got = client.models.retrieve("tiny")
    assert got == client.models.list().data[0]
    assert (got.id, got.object, got.owned_by) == ("tiny", "model", "kvlayout")


def test_retrieving_another_model_is_openai_s_404_naming_it(server):
    with pytest.raises(openai.NotFoundError) as info:
        server.client().models.retrieve("gpt-4o")
    error = info.value.body
    assert (error["code"], error["param"], error["type"]) == ("model_not_found", "model", "invalid_request_error")
    assert "'gpt-4o'" in error["message"] and "'tiny'" in error["message"]


# -- fields that change nothing


def test_a_message_name_is_accepted_on_each_role_and_changes_nothing(server, plain):
    named = [{**m, "name": f"{m['role']}_1"} for m in MESSAGES]
    r = server.client().chat.completions.create(**{**ASK, "messages": named})
    assert r.choices[0].message.content == plain


@pytest.mark.parametrize("extra", [
    {"service_tier": "flex"}, {"service_tier": None}, {"reasoning_effort": "low"}, {"reasoning_effort": "minimal"},
    {"store": False}, {"metadata": {"team": "kv", "run": "7"}}, {"user": "user-42"},
    {"parallel_tool_calls": False},
    {"service_tier": "auto", "reasoning_effort": "high", "store": False, "metadata": {}, "user": "u",
     "parallel_tool_calls": True},
])
def test_an_ignored_field_is_accepted_and_the_answer_is_the_same(server, plain, extra):
    r = server.client().chat.completions.create(**ASK, **extra)
    assert r.choices[0].message.content == plain


def test_include_obfuscation_is_accepted_and_the_stream_says_the_same(server, plain):
    for flag in (True, False):
        chunks = server.client().chat.completions.create(
            **ASK, stream=True, stream_options={"include_usage": True, "include_obfuscation": flag})
        chunks = list(chunks)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == plain
        assert chunks[-1].usage is not None  # include_usage still honoured beside it


@pytest.mark.parametrize("extra, param", [
    ({"service_tier": 5}, "service_tier"),
    ({"service_tier": "turbo"}, "service_tier"),
    ({"reasoning_effort": True}, "reasoning_effort"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    ({"store": "yes"}, "store"),
    ({"store": True}, "store"),  # nothing is stored here to read back: asked for, it is refused
    ({"metadata": ["a"]}, "metadata"),
    ({"metadata": {"a": 1}}, "metadata.a"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ({"user": 5}, "user"),
    ({"parallel_tool_calls": "no"}, "parallel_tool_calls"),
    ({"stream": True, "stream_options": {"include_obfuscation": "no"}}, "stream_options.include_obfuscation"),
    ({"messages": [MESSAGES[0], {**MESSAGES[1], "name": 7}]}, "messages[1].name"),
    ({"messages": [{**MESSAGES[1], "name": ["ann"]}]}, "messages[0].name"),
    ({"tool_choice": "required"}, "tool_choice"),  # one that would change the output stays refused
    ({"tools": [{"type": "function", "function": {"name": "f"}}], "parallel_tool_calls": False}, "tools"),
])
def test_a_wrong_type_is_a_400_naming_the_field(server, extra, param):
    with pytest.raises(openai.BadRequestError) as info:
        server.client().chat.completions.create(**{**ASK, **extra})
    assert info.value.body["param"] == param, info.value.body


# -- CORS


def preflight(live: Live, origin: str) -> tuple[int, dict]:
    return request(live, "OPTIONS", "/v1/chat/completions", {
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})


def test_an_allowed_origin_s_preflight_and_request_get_cors_headers(server, plain):
    status, headers = preflight(server, ORIGIN)
    assert status == 200 and headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in headers["access-control-allow-methods"]
    assert {"authorization", "content-type"} <= {h.strip().lower() for h in
                                                 headers["access-control-allow-headers"].split(",")}
    assert "access-control-allow-credentials" not in headers  # keys go in a header, never a cookie
    status, body, headers = server.post("/v1/chat/completions", ASK, {"Origin": ORIGIN})
    assert status == 200 and headers["access-control-allow-origin"] == ORIGIN
    assert body["choices"][0]["message"]["content"] == plain


def test_another_origin_gets_no_cors_header(server):
    status, headers = preflight(server, "http://evil.example")
    assert status == 400 and "access-control-allow-origin" not in headers  # so the browser refuses to go on
    status, _, headers = server.post("/v1/chat/completions", ASK, {"Origin": "http://evil.example"})
    assert status == 200 and "access-control-allow-origin" not in headers


def test_without_cors_origins_no_cors_header_is_sent(tiny_loaded):
    with serving(tiny_loaded) as live:
        status, headers = preflight(live, ORIGIN)
        assert status == 405 and not any(k.startswith("access-control-") for k in headers)
        _, _, headers = live.post("/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 1},
                                  {"Origin": ORIGIN})
        assert not any(k.startswith("access-control-") for k in headers)


def test_cors_origin_flags_reach_the_server_config(tmp_path):
    path = tmp_path / "serve.toml"
    path.write_text('[model]\npreset = "tiny"\n[server]\ncors_origins = ["https://a.example"]\n')
    args = make_parser().parse_args(["serve", str(path), "--cors-origin", "http://[::1]:8000",
                                     "--cors-origin", "*"])
    assert serve_config(args).server.cors_origins == ("https://a.example", "http://[::1]:8000", "*")


@pytest.mark.parametrize("origin", ["http://a.example/", "ftp://a.example", "a.example", "http://a.example:0",
                                    "https://a.example/app", "null"])
def test_a_bad_cors_origin_in_the_config_is_a_config_error_naming_the_key(origin):
    with pytest.raises(ConfigError, match=r"server\.cors_origins"):
        ServeConfig.from_mapping({**TINY, "server": {"cors_origins": [origin]}}, source="test")


def test_a_bad_cors_origin_flag_is_one_line_and_exit_2(tmp_path):
    done = subprocess.run([sys.executable, "-m", "kvlayout.cli", "serve", "--cors-origin", "http://a.example/x",
                           "--port", "0"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    said = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(said) == 1, done.stderr
    assert said[0].startswith("kvlayout: error: --cors-origin 'http://a.example/x'")


# -- the access log


def test_a_generating_request_logs_one_line_with_its_tokens_and_time(server, logged):
    since = len(logged.lines)
    r = server.client().completions.create(model="tiny", prompt="Q: logged?\nA:", max_tokens=3, temperature=0)
    m = logged.wait_for(r"POST /v1/completions 200", since)
    assert len(logged.lines) == since + 1
    assert (int(m[4]), int(m[5])) == (r.usage.prompt_tokens, r.usage.completion_tokens)
    assert float(m[6]) > 0


def test_refused_and_tokenless_requests_log_their_status_and_no_tokens(server, logged):
    since = len(logged.lines)
    with pytest.raises(openai.BadRequestError):
        server.client().completions.create(model="tiny", prompt="x", max_tokens=10**6)
    m = logged.wait_for(r"POST /v1/completions 400", since)
    assert m[4] is None
    request(server, "GET", "/v1/models/no%0Ameans%20no", {})
    m = logged.wait_for(r"GET /v1/models/no%0Ameans%20no 404", since)  # a client's newline cannot split the line
    assert m[4] is None


def test_the_access_log_never_shows_the_key_nor_the_body(server, logged):
    since = len(logged.lines)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="sk-secret-123", max_retries=0, timeout=60)
    client.chat.completions.create(**ASK)
    logged.wait_for(r"POST /v1/chat/completions 200", since)
    assert not any("sk-secret-123" in line or "Q: a cell" in line for line in logged.lines)
    assert all("\n" not in line and ACCESS.fullmatch(line) for line in logged.lines)


def test_kvlayout_serve_writes_each_access_line_once_on_stderr_off_the_event_loop(capfd):
    # `serve` puts the lines on stderr through a queue a thread of its own drains: the loop never waits
    # on a stderr nobody reads, and a full queue drops a line rather than block or raise.
    import queue

    from kvlayout.server.serve import DroppingQueueHandler, access_log_on_stderr

    undo = access_log_on_stderr()
    try:
        logging.getLogger(ACCESS_LOG).info("kvlayout: GET /health 200 1.0 ms")
    finally:
        undo()  # writes what is queued before it returns
    assert capfd.readouterr().err.splitlines().count("kvlayout: GET /health 200 1.0 ms") == 1
    full = DroppingQueueHandler(queue.Queue(1))
    for i in range(3):
        full.handle(logging.makeLogRecord({"msg": f"line {i}"}))
    assert full.queue.qsize() == 1 and capfd.readouterr().err == ""
