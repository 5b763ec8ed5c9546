"""Tenant isolation of the prefix cache: a client cannot learn another's prompt from
`usage.prompt_tokens_details.cached_tokens` (issue 33, item 1).

Prefixes are shared only between requests with the same isolation key: the API key's when keys
are configured, narrowed by the request's `cache_salt` when it sends one. Each test's control is
the owner repeating its own prompt, which must find it cached: a probe's 0 is then isolation, not
a cache that kept nothing.
"""

from __future__ import annotations

import concurrent.futures

import openai
import pytest

from tests.server.conftest import serving

KEYS = ["tenant-a-key", "tenant-b-key"]
SECRET = "The launch code for the vault is 80357 and the backup PIN is 4412; tell nobody about it. " * 2


def client(live, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{live.url}/v1", api_key=key, max_retries=0, timeout=60)


def cached(c: openai.OpenAI, prompt: str, **extra) -> int:
    """The prompt tokens a one-token completion of `prompt` found cached."""
    answer = c.completions.create(model="tiny", prompt=prompt, max_tokens=1, extra_body=extra or None)
    return answer.usage.prompt_tokens_details.cached_tokens


def chat_cached(c: openai.OpenAI, text: str, **extra) -> int:
    answer = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": text}], max_tokens=1,
                                       extra_body=extra or None)
    return answer.usage.prompt_tokens_details.cached_tokens


@pytest.fixture(scope="module")
def keyed(tiny_loaded):
    with serving(tiny_loaded, {"server": {"api_keys": KEYS}}) as server:
        yield server


@pytest.mark.parametrize("probe", [SECRET, SECRET[:-1], SECRET + "x"], ids=["whole", "shorter", "longer"])
def test_another_keys_probe_of_a_prompt_finds_nothing_cached_and_the_owner_finds_it(tiny_loaded, probe):
    with serving(tiny_loaded, {"server": {"api_keys": KEYS}}) as live:
        a, b = client(live, KEYS[0]), client(live, KEYS[1])
        assert cached(a, SECRET) == 0  # a fresh server: nothing kept yet
        assert cached(b, probe) == 0  # tenant B probes A's prompt
        assert cached(a, probe) > 16  # A's own repeat finds its prefix (the cache works)
        assert cached(b, probe) > 16  # and B's own earlier probe is B's to reuse


def test_chat_prompts_are_kept_apart_per_key_too(keyed):
    a, b = client(keyed, KEYS[0]), client(keyed, KEYS[1])
    text = "Chat. " + SECRET  # its own first block: no other test's prompt on this server starts so
    assert chat_cached(a, text) == 0
    assert chat_cached(b, text) == 0
    assert chat_cached(a, text) > 16


def test_a_cache_salt_shares_only_with_the_same_salt_without_keys(tiny_loaded):
    with serving(tiny_loaded) as live:
        c = client(live)
        assert cached(c, SECRET, cache_salt="alice") == 0
        assert cached(c, SECRET, cache_salt="bob") == 0  # another salt
        assert cached(c, SECRET) == 0  # no salt is not any salt
        assert cached(c, SECRET, cache_salt="alice") > 16  # the same salt shares
        assert cached(c, SECRET, cache_salt="bob") > 16
        assert cached(c, SECRET) > 16  # and no salt shares with no salt: the default, everyone alike


def test_a_cache_salt_narrows_a_keys_sharing(keyed):
    a, b = client(keyed, KEYS[0]), client(keyed, KEYS[1])
    prompt = "Salted. " + SECRET  # its own first block: no other test's prompt on this server starts so
    assert cached(a, prompt, cache_salt="s") == 0
    assert cached(a, prompt) == 0  # the same key without the salt
    assert cached(b, prompt, cache_salt="s") == 0  # the same salt under another key
    assert cached(a, prompt, cache_salt="s") > 16


def test_requests_still_prefilling_are_not_shared_across_keys(tiny_loaded):
    # Two tenants sending one long prompt at once: B must not clone A's prefill as it goes in.
    long = SECRET * 6
    with serving(tiny_loaded, {"server": {"api_keys": KEYS}, "engine": {"prefill_chunk": 16}}) as live:
        a, b = client(live, KEYS[0]), client(live, KEYS[1])
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            got = list(pool.map(lambda c: cached(c, long), [a, b]))
        assert got == [0, 0]
        assert cached(a, long) > 16 and cached(b, long) > 16


@pytest.mark.parametrize("salt", [123, "", ["x"], {"a": 1}, True])
def test_a_bad_cache_salt_is_400_naming_it(live, salt):
    status, body, _ = live.post("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 1,
                                                   "cache_salt": salt})
    assert status == 400 and body["error"]["param"] == "cache_salt", body
    assert "cache_salt must be a non-empty string" in body["error"]["message"]
