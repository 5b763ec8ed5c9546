"""The cell engine over a model with a sliding-window layer: its table keeps only each sequence's last
window (kvlayout_cell.layer_groups), and generation is what the cache-free forward gives.

The tiny model's layer 0 slides over a window of 8; layer 1 is flat. The oracle is the model run
over the whole sequence without a cache (tests.runner.conftest.oracle_greedy)."""

from __future__ import annotations

import attrs

from kvlayout.engines import CellEngine, EngineOptions, make_requests
from kvlayout.engines.prefixes import PrefixCache
from tests.engines.conftest import SYSTEM, cache_for
from tests.runner.conftest import oracle_greedy

WINDOW = 8


def engine(tiny, prefixes: bool, chunk: int = 16):
    model, args, tok = tiny
    cache = cache_for("cell", args)
    bc = cache.as_batch_control()
    kept = PrefixCache(bc) if prefixes else None
    options = EngineOptions(eos=frozenset(tok.eos_ids), chunk=chunk)
    return CellEngine(model, cache, bc, options, prefixes=kept), bc, kept


def test_the_window_layer_holds_its_windows_only_and_generation_is_the_cache_free_forwards(tiny):
    model, _, tok = tiny
    e, bc, _ = engine(tiny, prefixes=False)
    prompts = [tok.encode(SYSTEM + q) for q in ("Q: what is a KV cache?\nA:", "Q: why fork?\nA:")]
    reqs = make_requests(prompts, [40, 40], [1, 1], 3)
    e.add(reqs)
    seen = []
    while e.step():
        e.settle()
        seen.append(bc.cells_by_window())
    for r, p in zip(reqs, prompts):
        assert r.samples[0].generated == oracle_greedy(model, p, 40, frozenset(tok.eos_ids))[0]
    # Flat: every token of both sequences at the end; the window's table: at most the two windows
    # plus what one step brought (a 16-token prompt chunk and a decode token each) before the next
    # declaration retired what left them.
    longest = max(s[0] for s in seen)
    assert longest >= sum(len(p) for p in prompts) + 2 * 30
    assert max(s[WINDOW] for s in seen) <= 2 * WINDOW + 16 + 2
    # What the run reports (kvlayout run's K/V bytes): each table's own peak, noted as steps end.
    assert max(s[WINDOW] for s in seen) <= e.stats.peak_window_cells <= 2 * WINDOW + 16 + 2
    assert e.stats.peak_cells >= longest


def test_a_prompt_stays_whole_until_the_prefix_cache_keeps_it_and_later_ones_part_anywhere(tiny):
    model, _, tok = tiny
    e, bc, kept = engine(tiny, prefixes=True)
    first = tok.encode(SYSTEM + "Q: what is a KV cache?\nA:")
    e.add(make_requests([first], [12], [1], 3))
    e.run()
    prompt_entry = next(i for i, x in kept.entries.items() if len(x.tokens) == len(first))
    assert bc.seq_floor(prompt_entry) == 0  # pinned: every position of it can be continued
    sample_entry = next(i for i, x in kept.entries.items() if len(x.tokens) > len(first))
    assert bc.seq_floor(sample_entry) > len(first)  # decoded unpinned: its last window only
    second = tok.encode(SYSTEM + "Q: why fork?\nA:")
    [r] = [attrs.evolve(make_requests([second], [6], [1], 3)[0], index=1)]  # another request
    e.add([r])
    e.run()
    shared = next(i for i in range(len(second)) if second[i] != first[i])
    assert r.cached_tokens == shared  # parted inside the question, as without windows
    assert r.samples[0].generated == oracle_greedy(model, second, 6, frozenset(tok.eos_ids))[0]


def test_a_sample_ending_within_a_window_of_its_prompt_leaves_the_prompt_entry_to_lend_its_start(tiny):
    """Its own entry holds the prompt's end in the window layers, not its start: the pinned prompt
    entry stays, and a later prompt sharing only the start parts from it."""
    model, _, tok = tiny
    e, bc, kept = engine(tiny, prefixes=True)
    first = tok.encode(SYSTEM + "Q: what is a KV cache?\nA:")
    e.add(make_requests([first], [2], [1], 3))  # ends 2 tokens on: its floor is inside the prompt
    e.run()
    sample_entry = next(i for i, x in kept.entries.items() if len(x.tokens) > len(first))
    assert 0 < bc.seq_floor(sample_entry) < len(first)
    assert any(len(x.tokens) == len(first) for x in kept.entries.values())
    second = tok.encode(SYSTEM + "Q: why fork?\nA:")
    [r] = [attrs.evolve(make_requests([second], [4], [1], 3)[0], index=1)]
    e.add([r])
    e.run()
    assert r.cached_tokens == next(i for i in range(len(second)) if second[i] != first[i])
    assert r.samples[0].generated == oracle_greedy(model, second, 4, frozenset(tok.eos_ids))[0]
