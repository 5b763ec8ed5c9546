"""The official `openai` client against a live server (tiny preset): chat and text, whole and streamed.

The oracle for what is generated is `kvlayout run` on the same requests
(`runner.job`, in this process, the same weights) and, for one request, the
cache-free forward of tests/runner.
"""

from __future__ import annotations

import concurrent.futures

import attrs
import openai
import pytest

from kvlayout.runner.config import RunConfig
from kvlayout.runner.job import prepare
from tests.runner.conftest import oracle_greedy
from tests.server.conftest import serving

QUESTIONS = ["Q: what is a KV cache?\nA:", "Q: why fork?\nA:", "Q: what does a ring keep?\nA:", "Q: pages?\nA:",
             "Q: and cells?\nA:", "Q: who owns a cell?\nA:", "Q: what is freed?\nA:", "Q: when?\nA:"]
SYSTEM = "You are a terse assistant. Answer in one line.\n"


def run_texts(loaded, requests: list[dict]) -> list[list[str]]:
    """What `kvlayout run` generates for `requests` (greedy), each sample's text."""
    cfg = RunConfig.from_mapping({"model": {"preset": "tiny"}, "cache": {"capacity": 4096}, "requests": requests})
    result = prepare(attrs.evolve(cfg, plain_chat=True), loaded).generate()
    return [[s.text for s in samples] for samples in result.outputs]


def test_models_lists_the_one_served_model(live):
    models = live.client().models.list()
    assert [m.id for m in models.data] == ["tiny"]


def test_a_text_completion_is_what_the_cache_free_forward_generates(live, tiny_loaded):
    model, _, tok, _ = tiny_loaded
    prompt = SYSTEM + QUESTIONS[0]
    ids, reason = oracle_greedy(model, tok.encode(prompt), 12, frozenset(tok.eos_ids))
    r = live.client().completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0)
    assert r.object == "text_completion" and r.id.startswith("cmpl-")
    assert r.choices[0].text == tok.decode(ids)
    assert r.choices[0].finish_reason == reason
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(tok.encode(prompt)), len(ids))
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_a_chat_completion_whole_and_streamed_say_the_same_as_kvlayout_run(live, tiny_loaded):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[1]}]
    expected = run_texts(tiny_loaded, [{"messages": messages, "max_tokens": 10}])[0][0]
    client = live.client()
    whole = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == expected
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert len({c.id for c in chunks}) == 1 and chunks[0].object == "chat.completion.chunk"


def test_a_streamed_text_completion_without_usage_ends_with_its_finish_reason(live):
    chunks = list(live.client().completions.create(model="tiny", prompt="abc", max_tokens=4, stream=True))
    assert all(c.usage is None for c in chunks)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_n_samples_are_forks_of_one_prefill_and_each_a_choice(live):
    r = live.client().completions.create(model="tiny", prompt="Q: n?\nA:", max_tokens=6, n=3, temperature=1.0, seed=5)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    again = live.client().completions.create(
        model="tiny", prompt="Q: n?\nA:", max_tokens=6, n=3, temperature=1.0, seed=5
    )
    assert [c.text for c in r.choices] == [c.text for c in again.choices]  # a seed reproduces the samples
    assert 3 <= r.usage.completion_tokens <= 3 * 6  # each choice generated at least one token, at most max_tokens


def test_eight_concurrent_streaming_clients_get_what_kvlayout_run_gives(live, tiny_loaded):
    requests = [{"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}], "max_tokens": 8}
                for q in QUESTIONS]
    expected = run_texts(tiny_loaded, requests)

    def stream(req) -> str:
        chunks = live.client().chat.completions.create(model="tiny", messages=req["messages"], max_tokens=8,
                                                        temperature=0, stream=True)
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        got = list(pool.map(stream, requests))
    assert got == [e[0] for e in expected]


def test_a_stop_string_ends_the_sample_before_it(live, tiny_loaded):
    model, _, tok, _ = tiny_loaded
    prompt = SYSTEM + QUESTIONS[2]
    free = live.client().completions.create(model="tiny", prompt=prompt, max_tokens=12).choices[0].text
    stop = free[3:5]
    assert len(stop) == 2
    r = live.client().completions.create(model="tiny", prompt=prompt, max_tokens=12, stop=[stop])
    assert r.choices[0].text == free[: free.index(stop)] and r.choices[0].finish_reason == "stop"


def test_the_client_sees_a_bad_request_as_openai_s_error(live):
    with pytest.raises(openai.BadRequestError) as info:
        live.client().completions.create(model="tiny", prompt="x", max_tokens=100000)
    assert info.value.body["param"] == "max_tokens"
    with pytest.raises(openai.NotFoundError):
        live.client().completions.create(model="gpt-4", prompt="x")


def test_a_request_sharing_a_long_prefix_reuses_its_cells_and_says_the_same_as_a_cold_server(tiny_loaded):
    long_system = SYSTEM * 6  # ~280 tokens of the byte tokenizer
    first, second = (long_system + q for q in QUESTIONS[:2])
    answers = {}
    for reuse in (True, False):
        with serving(tiny_loaded, {"server": {"prefix_cache": reuse}}) as live:
            client = live.client()
            a = client.completions.create(model="tiny", prompt=first, max_tokens=8, temperature=0)
            b = client.completions.create(model="tiny", prompt=second, max_tokens=8, temperature=0)
            again = client.completions.create(model="tiny", prompt=second, max_tokens=8, temperature=0)
            answers[reuse] = [r.choices[0].text for r in (a, b, again)]
            cached = [r.usage.prompt_tokens_details.cached_tokens for r in (a, b, again)]
            if reuse:
                shared = next(i for i, (x, y) in enumerate(zip(first, second)) if x != y)  # one byte a token
                assert cached == [0, shared, len(second) - 1]
                assert live.health()["prefix_cache"]["hits"] == 2
            else:
                assert cached == [0, 0, 0] and live.health()["prefix_cache"] is None
    assert answers[True] == answers[False]
