"""API keys (server.auth): with keys, every route but /health and the page needs `Authorization:
Bearer KEY`, refused 401 in OpenAI's shape; the openai client with a key works; where the keys come
from on the command line, and what a mistake there says."""

from __future__ import annotations

import http.client
import json
import socket
import urllib.error
import urllib.request

import openai
import pytest

from kvlayout.server.auth import is_loopback
from tests.server.conftest import serving
from tests.server.test_cli import CONFIG, Process

KEYS = ["key-a-0123456789", "key-b-9876543210"]
# (method, path, body): every route a key guards; an unknown path is guarded too (a 401 tells nothing of it)
PROTECTED = [
    ("GET", "/v1/models", None),
    ("POST", "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                      "max_tokens": 2}),
    ("POST", "/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 2}),
    ("GET", "/stats", None),
    ("GET", "/metrics", None),
    ("GET", "/cells", None),
    ("GET", "/cells/at?cell=0", None),
    ("GET", "/no/such/route", None),
]


@pytest.fixture(scope="module")
def keyed(tiny_loaded):
    with serving(tiny_loaded, {"server": {"api_keys": KEYS}}) as server:
        yield server


def call(live, method: str, path: str, body: dict | None, headers: dict | None = None) -> tuple[int, dict, bytes]:
    """(status, headers, the body's first bytes) of one request; a stream is not read to its end."""
    conn = http.client.HTTPConnection("127.0.0.1", live.port, timeout=30)
    try:
        sent = {"Content-Type": "application/json", **(headers or {})}
        conn.request(method, path, json.dumps(body).encode() if body is not None else None, sent)
        resp = conn.getresponse()
        head = {k.lower(): v for k, v in resp.getheaders()}
        data = resp.read(4096) if "text/event-stream" in head.get("content-type", "") else resp.read()
        return resp.status, head, data
    finally:
        conn.close()


@pytest.mark.parametrize("method, path, body", PROTECTED, ids=[p for _, p, _ in PROTECTED])
@pytest.mark.parametrize("authorization", [None, "Bearer wrong-key", f"Bearer {KEYS[0]}x", f"Basic {KEYS[0]}",
                                           "Bearer ", KEYS[0]], ids=["none", "wrong", "longer", "basic", "empty",
                                                                     "no-scheme"])
def test_a_protected_route_without_a_right_key_is_401_in_openais_shape(keyed, method, path, body, authorization):
    headers = {"Authorization": authorization} if authorization is not None else {}
    status, head, data = call(keyed, method, path, body, headers)
    assert status == 401, data
    error = json.loads(data)["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_api_key"
    assert head["www-authenticate"] == "Bearer"
    assert KEYS[0] not in data.decode() and KEYS[1] not in data.decode()  # no key echoed back


@pytest.mark.parametrize("method, path, body", PROTECTED[:-1], ids=[p for _, p, _ in PROTECTED[:-1]])
@pytest.mark.parametrize("key", KEYS)
def test_a_protected_route_with_either_key_answers(keyed, method, path, body, key):
    status, _, data = call(keyed, method, path, body, {"Authorization": f"Bearer {key}"})
    assert status == 200, data


def test_health_and_the_page_stay_open(keyed):
    status, _, data = call(keyed, "GET", "/health", None)
    assert status == 200 and json.loads(data)["model"] == "tiny"
    status, head, data = call(keyed, "GET", "/", None)
    assert status == 200 and head["content-type"].startswith("text/html") and b"api-key-form" in data


def test_the_openai_client_with_a_key_works_and_with_a_wrong_one_is_refused(keyed):
    client = openai.OpenAI(base_url=f"{keyed.url}/v1", api_key=KEYS[1], max_retries=0, timeout=60)
    assert [m.id for m in client.models.list().data] == ["tiny"]
    answer = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello"}],
                                            max_tokens=4)
    assert answer.usage.completion_tokens == 4
    chunks = list(client.completions.create(model="tiny", prompt="hello", max_tokens=3, stream=True))
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    wrong = openai.OpenAI(base_url=f"{keyed.url}/v1", api_key="not-a-key", max_retries=0, timeout=60)
    with pytest.raises(openai.AuthenticationError) as refused:
        wrong.models.list()
    assert refused.value.status_code == 401 and refused.value.code == "invalid_api_key"


def test_without_keys_every_route_is_open(live):
    for method, path, body in PROTECTED[:-1]:
        status, _, data = call(live, method, path, body)
        assert status == 200, (path, data)


# -- the command line: --api-key, --api-key-file, KVLAYOUT_API_KEY


@pytest.fixture
def config_file(tmp_path) -> str:
    path = tmp_path / "serve.toml"
    path.write_text(CONFIG.format(grace=2))
    return str(path)


def get(url: str, key: str | None) -> int:
    req = urllib.request.Request(f"{url}/v1/models", headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code


def test_keys_from_the_flag_a_file_and_the_environment_all_let_in(config_file, tmp_path, monkeypatch):
    keys = tmp_path / "keys.txt"
    keys.write_text("# the team's keys\nfile-key-1\n\n  file-key-2  \n")
    monkeypatch.setenv("KVLAYOUT_API_KEY", "env-key")  # the server process inherits it
    server = Process([config_file, "--port", "0", "--api-key", "flag-key", "--api-key-file", str(keys)], tmp_path)
    try:
        url = server.ready()
        for key in ("flag-key", "file-key-1", "file-key-2", "env-key"):
            assert get(url, key) == 200, key
        for key in (None, "# the team's keys", "file-key"):
            assert get(url, key) == 401, key
        with urllib.request.urlopen(f"{url}/health", timeout=30) as resp:
            assert resp.status == 200
    finally:
        server.proc.send_signal(2)
        code, said = server.finish()
    assert code == 0 and "warning" not in said


@pytest.mark.parametrize("args, env, words", [
    (["--api-key", ""], None, "--api-key (number 1 given)"),
    (["--api-key", "ok", "--api-key", "has space"], None, "--api-key (number 2 given)"),
    (["--api-key-file", "no-such-keys.txt"], None, "--api-key-file no-such-keys.txt: cannot read it"),
    (["--api-key-file", "empty.txt"], None, "--api-key-file empty.txt: holds no key"),
    (["--api-key-file", "spaced.txt"], None, "--api-key-file spaced.txt: line 2 is not a key"),
    ([], "", "KVLAYOUT_API_KEY"),
])
def test_a_bad_key_flag_is_one_line_and_exit_2_and_shows_no_key(config_file, tmp_path, monkeypatch, args, env,
                                                                 words):
    (tmp_path / "empty.txt").write_text("\n# nothing\n")
    (tmp_path / "spaced.txt").write_text("good-key\nsecret with spaces\n")
    monkeypatch.delenv("KVLAYOUT_API_KEY", raising=False)
    if env is not None:
        monkeypatch.setenv("KVLAYOUT_API_KEY", env)
    code, said = Process([config_file, "--port", "0", *args], tmp_path).finish()
    assert code == 2 and words in said and "Traceback" not in said, said
    assert len(said.strip().splitlines()) == 1
    assert "secret" not in said and "good-key" not in said


@pytest.mark.parametrize("keyed_too", [False, True])
def test_a_host_beyond_loopback_without_a_key_warns_in_one_line(config_file, tmp_path, keyed_too):
    args = [config_file, "--host", "0.0.0.0", "--port", "0", *(["--api-key", "k1"] if keyed_too else [])]
    server = Process(args, tmp_path)
    try:
        server.ready()
    finally:
        server.proc.send_signal(2)
        code, said = server.finish()
    assert code == 0, said
    warnings = [line for line in said.splitlines() if "warning" in line]
    if keyed_too:
        assert warnings == []
    else:
        assert len(warnings) == 1 and "--host 0.0.0.0" in warnings[0] and "--api-key" in warnings[0]


def test_a_loopback_host_does_not_warn(config_file, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        code, said = Process([config_file, "--host", "127.0.0.1", "--port", str(taken.getsockname()[1])],
                             tmp_path).finish()
    assert code == 2 and "warning" not in said and len(said.strip().splitlines()) == 1, said


@pytest.mark.parametrize("host, loopback", [
    ("127.0.0.1", True), ("127.8.9.10", True), ("::1", True), ("[::1]", True), ("localhost", True),
    ("LocalHost", True), ("0.0.0.0", False), ("::", False), ("192.168.1.5", False), ("kv.example.org", False),
])
def test_which_hosts_count_as_this_machine_only(host, loopback):
    assert is_loopback(host) is loopback
