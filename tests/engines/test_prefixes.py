"""Prefix reuse across requests (engines.prefixes): the index against brute force, and the engine
with a prefix cache against the engine without one and the cache-free forward."""

from __future__ import annotations

import attrs
from hypothesis import given, settings
from hypothesis import strategies as st

from kvlayout.engines import CellEngine, EngineOptions, make_requests
from kvlayout.engines.prefixes import PrefixCache, common_length
from tests.engines.conftest import SYSTEM, outputs
from tests.runner.conftest import oracle_greedy

BLOCK = 4


class FakeControl:
    """Only what a PrefixCache calls: the ids it released, in order."""

    def __init__(self):
        self.removed: list[int] = []

    def seq_rm(self, seq_id: int) -> None:
        self.removed.append(seq_id)

    def seq_floor(self, seq_id: int) -> int:
        return 0  # no sliding-window layers: every entry lends any prefix of it


def brute_lcp(a, b, limit):
    n = 0
    while n < min(len(a), len(b), limit) and a[n] == b[n]:
        n += 1
    return n


tokens_st = st.lists(st.integers(0, 2), min_size=0, max_size=24)  # 3 symbols: prefixes shared often


@settings(max_examples=300, deadline=None)
@given(st.lists(tokens_st, max_size=8), st.lists(tokens_st, min_size=1, max_size=6))
def test_find_gives_the_longest_prefix_any_entry_shares_once_it_is_a_block_long(kept, queries):
    cache = PrefixCache(FakeControl(), block=BLOCK)
    for i, t in enumerate(kept):
        cache.keep(i, t)
    entries = {i: e.tokens for i, e in cache.entries.items()}
    for q in queries:
        limit = max(len(q) - 1, 0)
        best = max((brute_lcp(e, q, limit) for e in entries.values()), default=0)
        hit = cache.find(q, limit)
        if best < BLOCK:
            assert hit is None
            continue
        assert hit is not None and hit.seq_id in entries
        assert list(entries[hit.seq_id][: hit.length]) == q[: hit.length]  # a real prefix of both
        assert hit.length == best


@settings(max_examples=300, deadline=None)
@given(st.lists(tokens_st, max_size=10))
def test_kept_entries_are_those_no_other_entry_covers_and_the_rest_are_released(kept):
    control = FakeControl()
    cache = PrefixCache(control, block=BLOCK)
    for i, t in enumerate(kept):
        cache.keep(i, t)
    # Plain-Python model: an id is kept when it is a block long, and no later id's tokens start
    # with it (that one replaced it) and no earlier kept one's start with its (it was covered).
    model: dict[int, tuple] = {}
    for i, t in enumerate(map(tuple, kept)):
        if len(t) < BLOCK or any(e[: len(t)] == t for e in model.values()):
            continue
        model = {j: e for j, e in model.items() if t[: len(e)] != e}
        model[i] = t
    assert {i: e.tokens for i, e in cache.entries.items()} == model
    assert sorted(control.removed) == sorted(set(range(len(kept))) - set(model))
    assert len(control.removed) == len(set(control.removed))  # each id released once


def test_eviction_is_least_recently_used_first_and_spares_what_it_is_told():
    control = FakeControl()
    cache = PrefixCache(control, block=BLOCK)
    for i, t in enumerate([[1] * 8, [2] * 8, [3] * 8]):
        assert cache.keep(i, t)
    assert cache.find([1] * 9, 8).seq_id == 0  # used: now the most recent
    assert cache.evict(spare=1) and control.removed == [2]  # 1 is the oldest, but spared
    assert cache.evict() and control.removed == [2, 1]
    assert cache.evict() and control.removed == [2, 1, 0]
    assert not cache.evict() and cache.evictions == 3 and len(cache) == 0


def test_common_length_stops_at_the_first_difference_and_the_limit():
    assert common_length([1, 2, 3], [1, 2, 4], 5) == 2
    assert common_length([1, 2, 3], [1, 2, 3, 4], 2) == 2
    assert common_length([], [1], 3) == 0


# -- the engine with a prefix cache


def cell_engine(tiny, prefixes: bool, capacity: int = 1024, max_seqs: int = 16, chunk: int = 16):
    """A CellEngine over a fresh float32 cell cache, with a PrefixCache or without."""
    import kvlayout
    from kvlayout.config import CacheConfig

    model, args, tok = tiny
    config = CacheConfig(capacity=capacity, n_layers=args.num_hidden_layers, layers=args.layer_configs(),
                         kv_dtype="float32", max_seqs=max_seqs)
    cache = kvlayout.build("mlx", "cell", config)
    bc = cache.as_batch_control()
    kept = PrefixCache(bc) if prefixes else None
    options = EngineOptions(eos=frozenset(tok.eos_ids), chunk=chunk)
    return CellEngine(model, cache, bc, options, prefixes=kept), bc, kept


def assert_only_entries_hold(engine, bc, kept):
    """Nothing runs, and the table holds the entries and nothing else: every live id is an entry
    (the others are free: seq_new hands each out once), every occupied cell owned by entries only,
    and each entry owns exactly its tokens' positions."""
    assert not engine.has_work
    fresh = []
    while (sid := bc.seq_new()) is not None:
        fresh.append(sid)
    assert sorted(fresh) == sorted(set(range(bc.max_seqs)) - set(kept.entries))
    for sid in fresh:
        bc.seq_rm(sid)
    cells, positions, owners = engine.cache.as_cell_view().cell_owners()
    entry_ids = sorted(kept.entries)
    assert not owners[:, [i for i in range(bc.max_seqs) if i not in kept.entries]].any()
    for sid in entry_ids:
        assert sorted(positions[owners[:, sid]].tolist()) == list(range(len(kept.entries[sid].tokens)))


def one_by_one(engine, tok, prompts, max_tokens=6, n=1):
    """Each prompt as its own request, run to the end before the next is added (a server's
    clients, one after another)."""
    done = []
    for i, p in enumerate(prompts):
        r = make_requests([tok.encode(p)], [max_tokens], [n], 3)[0]
        r = attrs.evolve(r, index=i)
        engine.add([r])
        engine.run()
        done.append(r)
    return done


TURNS = [SYSTEM + "Q: what is a KV cache?\nA:", SYSTEM + "Q: what is a KV cell?\nA:",
         SYSTEM + "Q: what is a KV cache?\nA:", SYSTEM + "Q: why fork?\nA:"]


def test_requests_after_one_sharing_its_prefix_reuse_its_cells_and_generate_the_same(tiny):
    model, _, tok = tiny
    with_reuse, bc, kept = cell_engine(tiny, True)
    without, _, _ = cell_engine(tiny, False)
    got = one_by_one(with_reuse, tok, TURNS)
    cold = one_by_one(without, tok, TURNS)
    assert outputs(got) == outputs(cold)
    for r, p in zip(got, TURNS):  # and the cache-free forward
        assert r.samples[0].generated == oracle_greedy(model, tok.encode(p), 6, frozenset(tok.eos_ids))[0]
    prompts = [tok.encode(p) for p in TURNS]
    assert got[0].cached_tokens == 0
    assert got[1].cached_tokens == brute_lcp(prompts[0], prompts[1], 99)  # they part inside the question
    assert got[2].cached_tokens == len(prompts[2]) - 1  # the same prompt: all but the token that gives logits
    assert got[3].cached_tokens == brute_lcp(prompts[0], prompts[3], 99)
    assert with_reuse.stats.prefill_tokens == without.stats.prefill_tokens - sum(r.cached_tokens for r in got)
    assert kept.hits == 3 and kept.reused_tokens == sum(r.cached_tokens for r in got)


def test_requests_queued_behind_a_prefilling_prompt_reuse_it_once_it_is_in(tiny):
    _, _, tok = tiny
    prompts = [tok.encode(p) for p in TURNS[:2]]
    assert len(prompts[0]) % 16 == 8  # its last step leaves budget the second could have prefilled from scratch
    got, cold = [], []
    for prefixes, out in ((True, got), (False, cold)):
        engine, _, _ = cell_engine(tiny, prefixes, chunk=16)  # the first prompt takes five steps
        reqs = make_requests(prompts, [6, 6], [2, 2], 3)
        engine.add(reqs)
        engine.run()
        out.extend(reqs)
    assert outputs(got) == outputs(cold)
    assert got[1].cached_tokens == brute_lcp(prompts[0], prompts[1], 99)


def test_under_pressure_kept_prefixes_give_way_and_nothing_generated_changes(tiny):
    _, _, tok = tiny
    prompts = [SYSTEM + f"Q: question number {i} of many?\nA:" for i in range(10)]
    engine, bc, kept = cell_engine(tiny, True, capacity=256, max_seqs=4)
    cold, _, _ = cell_engine(tiny, False, capacity=256, max_seqs=4)
    got = one_by_one(engine, tok, prompts, max_tokens=8, n=2)
    assert outputs(got) == outputs(one_by_one(cold, tok, prompts, max_tokens=8, n=2))
    assert kept.evictions > 0 and kept.hits > 0
    assert_only_entries_hold(engine, bc, kept)
    # Everything at once as well, through preemption and eviction both.
    engine2, _, _ = cell_engine(tiny, True, capacity=256, max_seqs=4)
    reqs = make_requests([tok.encode(p) for p in prompts], [8] * 10, [2] * 10, 3)
    engine2.add(reqs)
    engine2.run()
    assert outputs(reqs) == outputs(got)


def test_cancel_ends_a_request_frees_what_it_generated_and_leaves_the_others_alone(tiny):
    model, _, tok = tiny
    heard = []
    engine, bc, kept = cell_engine(tiny, True)
    engine.options.on_token = lambda r, s, t: heard.append((r.index, s.index, t, s.finish_reason))
    reqs = make_requests([tok.encode(p) for p in TURNS[:2]], [40, 6], [2, 1], 3)
    engine.add(reqs)
    while not reqs[0].samples[0].generated:
        engine.step()
    engine.cancel(reqs[0])
    assert [s.finish_reason for s in reqs[0].samples] == ["cancelled", "cancelled"]
    assert [(i, j, t, f) for i, j, t, f in heard if f == "cancelled"] == [
        (0, 0, None, "cancelled"), (0, 1, None, "cancelled")
    ]
    engine.run()
    assert reqs[1].samples[0].generated == oracle_greedy(model, tok.encode(TURNS[1]), 6, frozenset(tok.eos_ids))[0]
    # Held now: the kept prefixes only (request 0's prompt, request 1's prompt and whole sequence:
    # tiny's sliding layer keeps only the last window of the sequence, which cannot lend its prompt).
    assert_only_entries_hold(engine, bc, kept)
    assert sorted(len(e.tokens) for e in kept.entries.values()) == sorted(
        [len(tok.encode(TURNS[0])), len(tok.encode(TURNS[1])), len(tok.encode(TURNS[1])) + 6 - 1])
    engine.cancel(reqs[0])  # nothing unfinished: nothing changes
    assert [s.finish_reason for s in reqs[0].samples] == ["cancelled", "cancelled"]


def test_a_request_finding_its_own_prefill_again_reports_no_cached_tokens(tiny):
    _, _, tok = tiny
    engine, bc, kept = cell_engine(tiny, True, max_seqs=2)
    [r] = make_requests([tok.encode(TURNS[0])], [4], [3], 3)  # 3 samples, 2 ids: the third prefills again
    engine.add([r])
    engine.run()
    assert kept.hits >= 1 and r.cached_tokens == 0  # what it found it had prefilled itself
    assert all(s.finish_reason in ("stop", "length") for s in r.samples)


def test_a_cell_engine_with_a_prefix_cache_refuses_to_save_its_state(tiny):
    import pytest

    from kvlayout.errors import KVLayoutError

    engine, _, _ = cell_engine(tiny, True)
    with pytest.raises(KVLayoutError, match="prefix cache"):
        engine.state()


# -- isolation: prefixes are shared only between sequences with the same isolation key

tenants_st = st.sampled_from(["", "tenant-a", "tenant-b"])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(tenants_st, tokens_st), max_size=10), st.lists(st.tuples(tenants_st, tokens_st),
                                                                         min_size=1, max_size=6))
def test_find_reuses_only_entries_of_the_same_isolation_key(kept, queries):
    control = FakeControl()
    cache = PrefixCache(control, block=BLOCK)
    for i, (tenant, t) in enumerate(kept):
        cache.keep(i, t, isolation=tenant)
    # Plain-Python model, per tenant: the kept-entries rule of the test above, applied to that
    # tenant's ids alone (another tenant's entry neither covers nor replaces one).
    model: dict[int, tuple[str, tuple]] = {}
    for i, (tenant, t) in enumerate((tenant, tuple(t)) for tenant, t in kept):
        mine = {j: e for j, (who, e) in model.items() if who == tenant}
        if len(t) < BLOCK or any(e[: len(t)] == t for e in mine.values()):
            continue
        model = {j: (who, e) for j, (who, e) in model.items() if who != tenant or t[: len(e)] != e}
        model[i] = (tenant, t)
    assert {i: (e.isolation, e.tokens) for i, e in cache.entries.items()} == model
    for tenant, q in queries:
        limit = max(len(q) - 1, 0)
        best = max((brute_lcp(e, q, limit) for who, e in model.values() if who == tenant), default=0)
        hit = cache.find(q, limit, isolation=tenant)
        if best < BLOCK:
            assert hit is None
            continue
        assert hit is not None and model[hit.seq_id][0] == tenant
        assert hit.length == best
        assert cache.covers(q, isolation=tenant) == any(
            len(e) >= len(q) and e[: len(q)] == tuple(q) for who, e in model.values() if who == tenant)


def test_the_same_tokens_under_two_isolation_keys_are_two_entries_and_neither_finds_the_other():
    control = FakeControl()
    cache = PrefixCache(control, block=BLOCK)
    prompt = list(range(12))
    assert cache.keep(1, prompt, isolation="a")
    assert cache.keep(2, prompt, isolation="b")  # not covered by a's: kept as its own entry
    assert set(cache.entries) == {1, 2} and control.removed == []
    assert cache.find(prompt + [99], 12, isolation="a").seq_id == 1
    assert cache.find(prompt + [99], 12, isolation="b").seq_id == 2
    assert cache.find(prompt + [99], 12, isolation="c") is None
    assert cache.find(prompt + [99], 12) is None  # no key at all is a key of its own
    # The chains differ from the first block: no index key is shared, not even by a collision's luck.
    assert set(cache.entries[1].keys).isdisjoint(cache.entries[2].keys)
