"""The prefix store on disk (engines.prefix_store), over the tiny model's real cell caches: what a
fresh store finds and loads is the K/V that was saved and continues like the cache-free forward;
foreign, damaged and vanished files are skipped with a line said; the byte budget evicts least
recently used entries whole; an unusable directory keeps nothing; stores sharing a directory
leave only whole entries; isolation keys never cross."""

from __future__ import annotations

import errno
import json
import os
import threading
import time
from pathlib import Path

import pytest

from kvlayout.engines import CellEngine, EngineOptions, make_requests
from kvlayout.engines.prefix_store import PrefixStore
from kvlayout.engines.prefixes import PrefixCache
from kvlayout.errors import StateError
from kvlayout.persist import read_state
from tests.engines.conftest import SYSTEM, cache_for
from tests.runner.conftest import oracle_greedy

IDENTITY = {"model": "tiny", "layout": "mlx:cell", "kv_dtype": "float32"}
FIRST = SYSTEM + "Q: what is a KV cache?\nA:"
SECOND = SYSTEM + "Q: what is a KV cell?\nA:"


def engine_over(tiny, cache):
    """A CellEngine over `cache` with a PrefixCache, greedy."""
    _, _, tok = tiny
    bc = cache.as_batch_control()
    kept = PrefixCache(bc)
    return CellEngine(tiny[0], cache, bc, EngineOptions(eos=frozenset(tok.eos_ids), chunk=16), prefixes=kept), kept


def run_prompt(engine, tok, prompt: str, max_tokens: int = 6):
    [r] = make_requests([tok.encode(prompt)], [max_tokens], [1], 3)
    engine.add([r])
    engine.run()
    return r


@pytest.fixture(scope="module")
def source(tiny):
    """(cache, seq id, tokens): a cell cache holding FIRST's prompt as a kept prefix of its own id."""
    _, args, tok = tiny
    cache = cache_for("cell", args)
    engine, kept = engine_over(tiny, cache)
    run_prompt(engine, tok, FIRST)
    prompt = tuple(tok.encode(FIRST))
    [seq_id] = [i for i, e in kept.entries.items() if e.tokens == prompt]
    return cache, seq_id, prompt


def store_over(directory, cache, budget=10**8, identity=IDENTITY):
    said: list[str] = []
    return PrefixStore(Path(directory), budget, identity, cache, said.append), said


def lcp(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def files(directory) -> list[str]:
    return sorted(os.listdir(directory))


def whole_entries(directory) -> dict[str, str]:
    """meta name -> the seq file it names, for every meta in `directory` (read as the file system has them)."""
    return {n: json.loads((Path(directory) / n).read_text())["seq"] for n in files(directory) if n.endswith(".json")}


# -- found and loaded again


def test_a_fresh_store_finds_the_prefix_and_loads_the_same_kv_which_continues_like_the_cache_free_forward(
        tiny, source, tmp_path):
    model, args, tok = tiny
    cache, seq_id, prompt = source
    store, said = store_over(tmp_path, cache)
    assert store.put(seq_id, prompt, "")
    assert store.put(seq_id, prompt, "") and store.snapshot()["writes"] == 1  # already stored: not rewritten

    fresh = cache_for("cell", args)
    again, said = store_over(tmp_path, fresh)  # a restarted server
    second = tok.encode(SECOND)
    found = again.best(second, len(second) - 1, "")
    assert found is not None and found[0].tokens == prompt and found[1] == lcp(prompt, second)
    new_id = again.load(found[0])
    assert new_id is not None and said == []
    assert again.snapshot()["hits"] == 1 and again.snapshot()["entries"] == 1

    # The same positions and K/V, bit for bit: both sequences saved, the files compared.
    a, b = read_state(cache.save_seq(seq_id, tmp_path / "a.kv")), read_state(fresh.save_seq(new_id, tmp_path / "b.kv"))
    assert a.state == b.state and sorted(a.tensors) == sorted(b.tensors)
    assert all(bytes(a.tensors[n].data) == bytes(b.tensors[n].data) for n in a.tensors)

    # Continued by an engine that takes it as a kept prefix: it reuses it and generates what the
    # cache-free forward does.
    engine, kept = engine_over(tiny, fresh)
    assert kept.keep(new_id, found[0].tokens)
    r = run_prompt(engine, tok, SECOND)
    assert r.cached_tokens == found[1]
    assert r.samples[0].generated == oracle_greedy(model, second, 6, frozenset(tok.eos_ids))[0]


def test_best_gives_the_longest_shared_prefix_of_whole_blocks_within_the_limit(source, tmp_path):
    cache, seq_id, _ = source  # the tokens here are hand-made: best reads only the meta
    store, _ = store_over(tmp_path, cache)
    p = list(range(100, 164))
    q = p[:20] + [7] * 30
    for tokens in (p[:32], p[:48], q):
        assert store.put(seq_id, tokens, "")
    assert store.best(p, 64, "")[0].tokens == tuple(p[:48]) and store.best(p, 64, "")[1] == 48
    assert store.best(p, 40, "")[1] == 40  # the limit caps it
    assert store.best(p[:20] + [7] * 5, 99, "")[1] == 25 and store.best(p[:20] + [7] * 5, 99, "")[0].tokens == tuple(q)
    assert store.best(p[:15] + [0] * 20, 99, "") is None  # less than one whole block shared
    assert store.best([1] * 40, 99, "") is None


def test_an_entry_a_longer_one_begins_with_goes_when_that_one_is_stored(source, tmp_path):
    cache, seq_id, _ = source  # hand-made tokens again: a conversation's first turn, then its second
    store, _ = store_over(tmp_path, cache)
    turn = list(range(200, 232))
    assert store.put(seq_id, turn, "") and store.put(seq_id, turn[:16] + [5] * 16, "")  # another branch: kept
    assert store.put(seq_id, turn, "other")  # another isolation key's copy: not covered by this key's turns
    assert len(whole_entries(tmp_path)) == 3
    assert store.put(seq_id, turn + list(range(300, 316)), "")
    metas = whole_entries(tmp_path)
    assert len(metas) == 3 and store.snapshot()["entries"] == 3  # the first turn went; the branch stays
    assert store.best(turn, 99, "")[0].tokens == tuple(turn + list(range(300, 316)))


def test_an_entry_of_one_isolation_key_is_never_found_under_another(source, tmp_path):
    cache, seq_id, prompt = source
    store, _ = store_over(tmp_path, cache)
    assert store.put(seq_id, prompt, "tenant-a")
    for other in ("", "tenant-b"):
        assert store.best(prompt, len(prompt), other) is None
    assert store.put(seq_id, prompt, "tenant-b")  # the same tokens: an entry of its own
    assert len(whole_entries(tmp_path)) == 2
    again, _ = store_over(tmp_path, cache)
    for who in ("tenant-a", "tenant-b"):
        stored, length = again.best(prompt, len(prompt), who)
        assert stored.isolation == who and length == len(prompt)
    assert again.best(prompt, len(prompt), "") is None


# -- what is not this store's, or not whole


def test_entries_of_another_identity_are_ignored_left_alone_and_said_once(source, tmp_path):
    cache, seq_id, prompt = source
    store, _ = store_over(tmp_path, cache)
    assert store.put(seq_id, prompt, "") and store.put(seq_id, prompt[:40], "")
    before = files(tmp_path)
    other, said = store_over(tmp_path, cache, identity={**IDENTITY, "model": "another"})
    assert said == [f"{tmp_path}: 2 stored prefixes of another model/layout ignored"]
    assert other.best(prompt, len(prompt), "") is None and other.snapshot()["entries"] == 0
    assert other.snapshot()["skipped"] == 2 and files(tmp_path) == before


@pytest.mark.parametrize("damage", ["truncated", "garbage", "vanished"])
def test_a_damaged_or_vanished_seq_file_fails_its_load_in_one_line_and_the_entry_is_forgotten(
        tiny, source, tmp_path, damage):
    cache, seq_id, prompt = source
    store, _ = store_over(tmp_path, cache)
    assert store.put(seq_id, prompt, "")
    [seq] = [tmp_path / n for n in files(tmp_path) if n.endswith(".seq")]
    if damage == "truncated":
        seq.write_bytes(seq.read_bytes()[: seq.stat().st_size // 2])
    elif damage == "garbage":
        seq.write_bytes(os.urandom(seq.stat().st_size))
    else:
        seq.unlink()
    again, said = store_over(tmp_path, cache_for("cell", tiny[1]))
    found = again.best(prompt, len(prompt), "")
    if damage == "vanished":  # seen at the start already: a meta without its seq file is removed there
        assert found is None and len(said) == 1 and seq.name in said[0]
    else:
        assert found is not None and said == []
        assert again.load(found[0]) is None
        assert len(said) == 1 and str(seq) in said[0] and again.snapshot()["loads_failed"] == 1
        assert again.best(prompt, len(prompt), "") is None
    assert files(tmp_path) == []  # both of its files gone


def test_garbage_metas_are_skipped_and_named_a_few_then_counted(source, tmp_path):
    cache, seq_id, prompt = source
    store, _ = store_over(tmp_path, cache)
    assert store.put(seq_id, prompt, "")
    good = files(tmp_path)
    bad = [f"{i:064x}.json" for i in range(5)]
    for i, name in enumerate(bad):
        (tmp_path / name).write_text(["{not json", "[]", '{"kvlayout_prefix": 1}', "", '{"kvlayout_prefix": 1, '
                                      '"tokens": [1], "identity": "x", "isolation": "", "seq": "y", "nbytes": 1}'][i])
    again, said = store_over(tmp_path, cache)
    assert len(said) == 4 and all(str(tmp_path / n) in line for n, line in zip(sorted(bad), said[:3]))
    assert "2 more" in said[3]
    assert again.snapshot()["entries"] == 1 and again.snapshot()["skipped"] == 5
    assert again.best(prompt, len(prompt), "")[0].tokens == prompt
    assert files(tmp_path) == good  # the damaged metas removed, the whole entry left


# -- the budget


def test_puts_beyond_the_budget_evict_the_least_recently_used_whole(source, tmp_path):
    cache, seq_id, _ = source
    store, _ = store_over(tmp_path, cache)
    entries = [[i] * 32 for i in range(3)]
    assert store.put(seq_id, entries[0], "")
    size = store.snapshot()["bytes"]
    store, _ = store_over(tmp_path, cache, budget=2 * size + size // 2)
    assert store.put(seq_id, entries[1], "")
    time.sleep(0.05)  # the meta's mtime is the persisted use order
    assert store.put(seq_id, entries[0], "") and store.snapshot()["writes"] == 1  # stored: only touched
    time.sleep(0.05)
    assert store.put(seq_id, entries[2], "")
    assert store.snapshot()["evictions"] == 1 and store.snapshot()["bytes"] == 2 * size
    assert store.best(entries[1], 32, "") is None  # the least recently used went
    assert all(store.best(entries[i], 32, "")[0].tokens == tuple(entries[i]) for i in (0, 2))
    assert len(whole_entries(tmp_path)) == 2 and len([n for n in files(tmp_path) if n.endswith(".seq")]) == 2
    assert set(whole_entries(tmp_path).values()) == {n for n in files(tmp_path) if n.endswith(".seq")}
    # A restart under a budget of one entry keeps the most recently used (entry 0 was touched before 2 was put).
    again, _ = store_over(tmp_path, cache, budget=size)
    assert again.snapshot()["entries"] == 1 and again.best(entries[2], 32, "") is not None
    assert len(files(tmp_path)) == 2


def test_an_entry_larger_than_the_budget_is_refused_and_leaves_no_file(source, tmp_path):
    cache, seq_id, prompt = source
    probe, _ = store_over(tmp_path / "probe", cache)
    assert probe.put(seq_id, prompt, "")
    store, said = store_over(tmp_path / "small", cache, budget=probe.snapshot()["bytes"] - 1)
    assert not store.put(seq_id, prompt, "") and files(tmp_path / "small") == [] and said == []
    assert store.snapshot()["entries"] == 0 and store.snapshot()["writes"] == 0


def test_a_prefix_shorter_than_a_block_is_not_stored(source, tmp_path):
    cache, seq_id, prompt = source
    store, _ = store_over(tmp_path, cache)
    assert not store.put(seq_id, prompt[:15], "") and files(tmp_path) == []


# -- what the file system refuses


def unusable_directories(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    yield blocker / "store"  # under a regular file: no one can create it, root included
    if os.geteuid() != 0:  # root writes through 0o500
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        yield locked


def test_an_unusable_directory_is_said_once_and_the_store_keeps_nothing(source, tmp_path):
    cache, seq_id, prompt = source
    for directory in unusable_directories(tmp_path):
        store, said = store_over(directory, cache)
        assert len(said) == 1 and str(directory) in said[0]
        assert not store.put(seq_id, prompt, "") and store.best(prompt, len(prompt), "") is None
        assert store.snapshot()["entries"] == 0 and len(said) == 1
    assert files(tmp_path) == ["a-file"] + (["locked"] if os.geteuid() != 0 else [])
    if os.geteuid() != 0:
        assert files(tmp_path / "locked") == []


class FullDisk:
    """A cache whose file system fills up as save_seq ends: the whole file is there when it raises."""

    def __init__(self, cache):
        self.cache = cache

    def save_seq(self, seq_id, path):
        self.cache.save_seq(seq_id, path)
        raise StateError(f"{path}: cannot write") from OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_full_disk_is_said_once_answered_false_and_leaves_no_file(source, tmp_path):
    cache, seq_id, prompt = source
    said: list[str] = []
    store = PrefixStore(tmp_path, 10**8, IDENTITY, FullDisk(cache), said.append)
    for n in (32, 48):
        assert not store.put(seq_id, prompt[:n], "")
    assert len(said) == 1 and os.strerror(errno.ENOSPC) in said[0]
    assert store.snapshot()["write_failures"] == 2 and store.snapshot()["entries"] == 0
    assert files(tmp_path) == []


# -- two stores on one directory


class Locked:
    """A cache shared by threads: its save_seq one at a time (MLX work), the stores' file work concurrent."""

    def __init__(self, cache):
        self.cache, self.lock = cache, threading.Lock()

    def save_seq(self, seq_id, path):
        with self.lock:
            return self.cache.save_seq(seq_id, path)


def test_two_stores_writing_one_directory_at_once_leave_only_whole_loadable_entries(tiny, source, tmp_path):
    cache, seq_id, prompt = source
    shared = Locked(cache)
    probe, _ = store_over(tmp_path / "probe", cache)
    assert probe.put(seq_id, prompt, "")
    size = probe.snapshot()["bytes"]
    token_sets = [[i] * 16 + list(prompt[:16]) for i in range(8)]  # distinct entries, some put by both
    stores = [store_over(tmp_path / "shared", shared, budget=4 * size)[0] for _ in range(2)]
    errors = []

    def writer(store, order):
        try:
            for _ in range(3):
                for i in order:
                    store.put(seq_id, token_sets[i], "")
        except BaseException as exc:  # a thread's exception is otherwise lost
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(stores[0], range(8))),
               threading.Thread(target=writer, args=(stores[1], reversed(range(8))))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    names = files(tmp_path / "shared")
    metas = whole_entries(tmp_path / "shared")
    assert metas and set(metas.values()) == {n for n in names if n.endswith(".seq")}  # no orphan, none missing
    assert all(not n.startswith(".") for n in names)  # no temporary or tombstone left
    reader, said = store_over(tmp_path / "shared", cache_for("cell", tiny[1]))
    loaded = 0
    assert reader.snapshot()["entries"] == len(metas)
    for tokens in token_sets:
        found = reader.best(tokens, 32, "")
        if found is not None and found[1] == 32:
            assert reader.load(found[0]) is not None
            loaded += 1
    assert loaded == len(metas)
    assert said == []


class Interleaved:
    """A cache whose save_seq, once its file is written, lets another store put the same entry first."""

    def __init__(self, cache, meanwhile):
        self.cache, self.meanwhile = cache, meanwhile

    def save_seq(self, seq_id, path):
        out = self.cache.save_seq(seq_id, path)
        self.meanwhile()
        return out


def test_a_store_publishing_second_takes_the_first_ones_entry_and_drops_its_own_file(tiny, source, tmp_path):
    cache, seq_id, prompt = source
    first, _ = store_over(tmp_path, cache)
    second, said = store_over(tmp_path, Interleaved(cache, lambda: first.put(seq_id, prompt, "")))
    assert second.put(seq_id, prompt, "") and said == []
    [meta] = whole_entries(tmp_path).items()
    assert files(tmp_path) == sorted(meta)  # one meta, the seq file it names, nothing else
    for store in (first, second):
        assert store.best(prompt, len(prompt), "")[1] == len(prompt) and store.snapshot()["bytes"] > 0
    fresh, _ = store_over(tmp_path, cache_for("cell", tiny[1]))
    assert fresh.load(fresh.best(prompt, len(prompt), "")[0]) is not None


def test_evicting_an_entry_another_store_wrote_again_since_leaves_that_store_s_files(tiny, source, tmp_path):
    cache, seq_id, _ = source
    old, new = [1] * 32, [2] * 32
    evictor, _ = store_over(tmp_path, cache)
    assert evictor.put(seq_id, old, "")
    size = evictor.snapshot()["bytes"]
    evictor, _ = store_over(tmp_path, cache, budget=size + size // 2)  # knows `old` by its first seq file
    for name in files(tmp_path):  # a third store evicted it...
        (tmp_path / name).unlink()
    writer, _ = store_over(tmp_path, cache)
    assert writer.put(seq_id, old, "")  # ...and this one wrote it again, under a seq file of its own
    rewritten = whole_entries(tmp_path)
    assert evictor.put(seq_id, new, "") and evictor.snapshot()["evictions"] == 1
    assert evictor.best(old, 32, "") is None  # gone from the evictor's view, but not its files
    assert {k: v for k, v in whole_entries(tmp_path).items() if k in rewritten} == rewritten
    assert set(whole_entries(tmp_path).values()) == {n for n in files(tmp_path) if n.endswith(".seq")}
    fresh, _ = store_over(tmp_path, cache_for("cell", tiny[1]))
    assert fresh.load(fresh.best(old, 32, "")[0]) is not None
