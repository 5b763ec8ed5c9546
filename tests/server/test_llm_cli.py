"""Simon Willison's `llm` command-line tool against a live kvlayout server, configured as a user would:
an `extra-openai-models.yaml` (a chat model and a `completion: true` model, `api_base` the server, no key)
in a temporary `LLM_USER_PATH`, `llm` run as a subprocess (`python -m llm`), its log read back with
`llm logs --json`. The user's own llm configuration is never read or written.

The oracles are independent of llm: the official `openai` client sending the same request llm sends
(llm streams by default, with `stream_options.include_usage`, and sends the prompt as one user message with
no system prompt: the log is checked to hold no system prompt), on the tiny preset's greedy server;
Python's `json.loads` for the `json_object` answer.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

CHAT_ID = "kvlayout-chat"
COMPLETION_ID = "kvlayout-completion"
LLM_TIMEOUT_S = 60
# seed 2 at temperature 0.8 on "Answer in JSON.": the random model closes a one-key object well within 200 tokens
JSON_SEED = 2
JSON_PROMPT = "Answer in JSON."


def models_yaml(live) -> str:
    """The user's extra-openai-models.yaml: OpenAI-compatible models at the server's /v1, no API key."""
    return "".join(f"- model_id: {model_id}\n  model_name: {live.model}\n  api_base: {live.url}/v1\n{extra}"
                   for model_id, extra in ((CHAT_ID, ""), (COMPLETION_ID, "  completion: true\n")))


@pytest.fixture
def llm_home(live, tmp_path) -> Path:
    home = tmp_path / "llm-user"
    home.mkdir()
    (home / "extra-openai-models.yaml").write_text(models_yaml(live), encoding="utf-8")
    return home


def run_llm(home: Path, *args: str) -> str:
    """`llm ARGS` with `home` as its user directory and only its default plugins; its stdout (it must succeed)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LLM_", "OPENAI_"))}
    env.update(LLM_USER_PATH=str(home), LLM_LOAD_PLUGINS="", PYTHONIOENCODING="utf-8")
    done = subprocess.run([sys.executable, "-m", "llm", *args], env=env, capture_output=True,
                          encoding="utf-8", timeout=LLM_TIMEOUT_S, check=False)
    assert done.returncode == 0, f"llm {args} failed ({done.returncode}): {done.stderr[-2000:]}"
    return done.stdout


def last_logged(home: Path) -> dict:
    """The newest response in llm's log database under `home`, as `llm logs --json` shows it."""
    rows = json.loads(run_llm(home, "logs", "--json", "-n", "1"))
    assert len(rows) == 1
    return rows[0]


def streamed_chat_text(live, content: str, **kw) -> tuple[str, str]:
    """(text, finish_reason) of the streamed chat request llm sends for a prompt `content`."""
    chunks = live.client().chat.completions.create(
        model=live.model, messages=[{"role": "user", "content": content}], stream=True,
        stream_options={"include_usage": True}, **kw)
    text, finish = "", ""
    for chunk in chunks:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    return text, finish


def test_plain_prompt_prints_what_the_openai_client_gets(live, llm_home):
    printed = run_llm(llm_home, "-m", CHAT_ID, "-o", "temperature", "0", "-o", "max_tokens", "8", "hello")
    expected, _ = streamed_chat_text(live, "hello", temperature=0, max_tokens=8)
    assert expected, "the oracle produced no text"
    assert printed == expected + "\n"  # llm ends its output with a newline

    logged = last_logged(llm_home)
    assert logged["model"] == CHAT_ID
    assert (logged["prompt"], logged["system"]) == ("hello", None)  # one user message, as the oracle sends
    assert logged["response"] == expected
    assert logged["response_json"]["usage"]["completion_tokens"] <= 8


def test_json_object_option_gives_a_json_object(live, llm_home):
    sampling = {"temperature": 0.8, "seed": JSON_SEED, "max_tokens": 200}
    options = [arg for name, value in sampling.items() for arg in ("-o", name, str(value))]
    printed = run_llm(llm_home, "-m", CHAT_ID, "-o", "json_object", "1", *options, JSON_PROMPT)
    answer = json.loads(printed)
    assert isinstance(answer, dict) and answer, f"not a non-empty JSON object: {printed!r}"

    expected, finish = streamed_chat_text(live, JSON_PROMPT, response_format={"type": "json_object"}, **sampling)
    assert (printed, finish) == (expected + "\n", "stop")  # the same seeded request through the openai client


def streamed_completion_logprobs(live, prompt: str, **kw) -> tuple[str, list[tuple[str, list[dict]]]]:
    """(text, [(chunk text, its tokens' top alternatives)]) of the streamed completion request llm sends."""
    chunks = live.client().completions.create(model=live.model, prompt=prompt, stream=True,
                                              stream_options={"include_usage": True}, **kw)
    text, entries = "", []
    for chunk in chunks:
        for choice in chunk.choices:
            text += choice.text
            if choice.logprobs and choice.logprobs.top_logprobs:
                entries.append((choice.text, choice.logprobs.top_logprobs))
    return text, entries


def test_completion_model_logs_the_logprobs(live, llm_home):
    prompt, sampling = "The cat", {"temperature": 0, "max_tokens": 4, "logprobs": 2}
    options = [arg for name, value in sampling.items() for arg in ("-o", name, str(value))]
    printed = run_llm(llm_home, "-m", COMPLETION_ID, *options, prompt)
    expected, expected_entries = streamed_completion_logprobs(live, prompt, **sampling)
    assert printed == expected + "\n"

    logged = last_logged(llm_home)
    assert logged["model"] == COMPLETION_ID and logged["response"] == expected
    entries = logged["response_json"]["logprobs"]  # llm keeps each streamed chunk's text and top alternatives
    assert len(entries) == len(expected_entries)
    assert sum(len(entry["top_logprobs"]) for entry in entries) == sampling["max_tokens"]  # one list per token
    for entry, (text, tops) in zip(entries, expected_entries, strict=True):
        assert entry["text"] == text
        for logged_top, top in zip(entry["top_logprobs"], tops, strict=True):
            assert len(logged_top) == 2 and logged_top.keys() == top.keys()
            assert logged_top == pytest.approx(top, abs=1e-4)
