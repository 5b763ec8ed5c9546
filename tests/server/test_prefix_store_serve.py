"""`server.prefix_store`: kept prefixes written to a directory (evicted from the cells, or all of them when the
server stops) and loaded again by a later server for prompts that start with them (issue 30).

Oracles: the same greedy request to a server without any prefix cache (every token prefilled), and the
directory's own files. The tiny preset, its byte tokenizer: a prompt of N characters is N tokens.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from kvlayout.cli import make_parser, serve_config
from kvlayout.errors import ConfigError
from kvlayout.server.config import ServeConfig
from tests.server.conftest import serving

SYSTEM = "You are a terse assistant who answers in one line, always, whatever the question. " * 3
ASK = {"model": "tiny", "max_tokens": 8, "temperature": 0}


def complete(live, prompt: str) -> tuple[str, int]:
    """(text, cached prompt tokens) of one greedy completion."""
    status, body, _ = live.post("/v1/completions", {**ASK, "prompt": prompt})
    assert status == 200, body
    return body["choices"][0]["text"], body["usage"]["prompt_tokens_details"]["cached_tokens"]


def stored_files(directory: Path) -> list[Path]:
    return sorted(p for p in directory.rglob("*") if p.is_file())


@pytest.fixture(scope="module")
def plain(tiny_loaded) -> dict[str, str]:
    """The oracle: each prompt's greedy answer with no prefix cache at all."""
    with serving(tiny_loaded, {"server": {"prefix_cache": False}}) as live:
        return {p: complete(live, p)[0] for p in (SYSTEM + "Q: cells?\nA:", SYSTEM + "Q: pages?\nA:")}


def test_a_restarted_server_loads_the_stored_prefix_instead_of_prefilling_it(tiny_loaded, plain, tmp_path):
    store = tmp_path / "store"
    first, second = list(plain)
    with serving(tiny_loaded, {"server": {"prefix_store": str(store)}}) as live:
        assert complete(live, first) == (plain[first], 0)  # cold: nothing in cells, nothing stored
    assert stored_files(store), "the server stopped without writing its kept prefixes"
    with serving(tiny_loaded, {"server": {"prefix_store": str(store)}}) as live:
        text, cached = complete(live, second)  # shares the system prompt with what the first server kept
        health = live.health()
        metrics = live.connection()
        metrics.request("GET", "/metrics")
        scraped = metrics.getresponse().read().decode()
    assert text == plain[second]
    assert cached >= len(SYSTEM) - 16  # the shared system prompt, to within a block of the index
    assert health["prefix_cache"]["store"]["hits"] == 1
    assert "kvlayout_prefix_store_hits_total 1.0" in scraped


def test_a_store_of_another_model_is_not_used_and_says_so(tiny_loaded, plain, tmp_path, caplog):
    store = tmp_path / "store"
    first = next(iter(plain))
    with serving(tiny_loaded, {"server": {"prefix_store": str(store)}}) as live:
        complete(live, first)
    other = {"model": {"preset": "tiny", "seed": 7}, "server": {"prefix_store": str(store)}}
    with caplog.at_level(logging.WARNING, logger="kvlayout.server"), serving(None, other) as live:
        _, cached = complete(live, first)
    assert cached == 0
    assert any("another" in r.getMessage() for r in caplog.records), [r.getMessage() for r in caplog.records]


def test_a_damaged_store_entry_is_skipped_named_and_the_answer_stays_right(tiny_loaded, plain, tmp_path, caplog):
    store = tmp_path / "store"
    first, second = list(plain)
    with serving(tiny_loaded, {"server": {"prefix_store": str(store)}}) as live:
        complete(live, first)
    for path in stored_files(store):
        if path.suffix != ".json":
            path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])  # truncated K/V
    with caplog.at_level(logging.WARNING, logger="kvlayout.server"), \
            serving(tiny_loaded, {"server": {"prefix_store": str(store)}}) as live:
        text, cached = complete(live, second)
    assert (text, cached) == (plain[second], 0)
    assert any("prefix store" in r.getMessage() for r in caplog.records)


def test_an_unwritable_store_leaves_the_server_serving(tiny_loaded, plain, tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    first = next(iter(plain))
    with caplog.at_level(logging.WARNING, logger="kvlayout.server"), \
            serving(tiny_loaded, {"server": {"prefix_store": str(blocker / "store")}}) as live:
        assert complete(live, first)[0] == plain[first]
    assert any("prefix store" in r.getMessage() for r in caplog.records)


def test_the_flag_and_the_keys_name_what_is_wrong(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = make_parser().parse_args(["serve", "--prefix-store", "kept"])
    assert serve_config(args).prefix_store_dir() == tmp_path / "kept"  # from where the command runs
    for server, key in (({"prefix_store_bytes": 0}, "server.prefix_store_bytes"),
                        ({"prefix_store": ""}, "server.prefix_store"), ({"prefix_store": 5}, "server.prefix_store")):
        with pytest.raises(ConfigError, match=key):
            ServeConfig.from_mapping({"server": server}, source="serve.toml")
