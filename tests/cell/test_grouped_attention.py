"""Grouped attention: the same steps through the dense mask and through groups give one result.

Four caches (attention_path dense, grouped, paged, auto) receive identical
steps, K/V and queries; every layer's `attend()` output must agree to 1e-5 in
float32. The steps cover batched prefill chunks of several sequences, ragged
lengths, forks sharing prefix cells, ring windows and freed cells refilled.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kvlayout import CacheConfig, ConfigError, LayerConfig, LayerPolicy, MaskKind
from kvlayout.mlx import attend
from kvlayout.registry import make_plugin_manager
from kvlayout_cell.cache import CellCache
from kvlayout_cell.groups import PLACEMENT_PAGE, choose, dense_cost, grouped_cost, page_batch, plan_groups

H_Q, H_KV, D = 4, 2, 8
SCALE = D**-0.5
LAYERS = [
    LayerConfig(H_KV, D),
    LayerConfig(H_KV, D, LayerPolicy("ring", 3)),
    LayerConfig(H_KV, D, LayerPolicy("ring", 5)),
]


def trio(capacity=128, kv_dtype="float32"):
    config = CacheConfig(
        capacity=capacity, n_layers=len(LAYERS), layers=LAYERS, kv_dtype=kv_dtype, initial_capacity=4, max_seqs=8
    )
    caches = {}
    for path in ("dense", "grouped", "paged", "auto"):
        c = CellCache(config, make_plugin_manager())
        c.attention_path = path
        caches[path] = c
    return caches


PAGED = {"grouped": 0, "paged": 0, "auto": 0}  # batches read by pages, per path, over the module
TAILS = dict.fromkeys(PAGED, 0)  # paged batches that also gathered cells


def serve(caches, tokens, rng, specs=None):
    """One step `[(seq, pos), ...]` on every cache; per path, the attend() output of each layer.
    `specs`, a dict when given, receives per path the spec each layer was given."""
    seqs, positions = [s for s, _ in tokens], [p for _, p in tokens]
    T = len(tokens)
    shapes = ((1, H_Q, T, D), (1, H_KV, T, D), (1, H_KV, T, D))  # q, k, v
    data = [[mx.array(rng.normal(size=shape).astype(np.float32)) for shape in shapes] for _ in LAYERS]
    outs, grouped = {}, {}
    for path, c in caches.items():
        assert c.as_batch_control().declare_step(seqs)
        outs[path], grouped[path] = [], []
        for layer, (q, k, v) in enumerate(data):
            spec = c.update_and_fetch(layer, positions, k, v)
            if specs is not None:
                specs.setdefault(path, []).append(spec)
            grouped[path].append(spec.groups is not None)
            if spec.groups is not None:
                pages = [b.page for b in spec.groups.batches()]
                assert path in ("paged", "auto") or not any(pages)
                PAGED[path] += sum(p > 0 for p in pages)
                TAILS[path] += sum(b.tail is not None for b in spec.groups.batches())
            outs[path].append(np.array(attend(q, spec, SCALE)))
    assert not any(grouped["dense"]) and all(grouped["grouped"]) and all(grouped["paged"])
    for layer in range(len(LAYERS)):
        for path in ("grouped", "paged", "auto"):
            np.testing.assert_allclose(outs[path][layer], outs["dense"][layer], atol=1e-5, rtol=1e-5)
    return grouped["auto"][0]


def on_all(caches, verb, *args):
    answers = {getattr(c.as_batch_control(), verb)(*args) for c in caches.values()}
    assert len(answers) == 1
    return answers.pop()


def prefill_chunk(lengths, starts=None):
    """Tokens of one batched prefill chunk: sequence s from starts[s] for lengths[s] tokens."""
    starts = starts or [0] * len(lengths)
    return [(s, starts[s] + i) for s, n in enumerate(lengths) for i in range(n)]


def test_a_batched_ragged_prefill_then_decode_agree_both_ways(rng):
    caches = trio()
    for _ in range(4):
        on_all(caches, "seq_new")
    serve(caches, prefill_chunk([7, 1, 4, 2]), rng)
    serve(caches, prefill_chunk([3, 5, 1, 6], starts=[7, 1, 4, 2]), rng)
    for step in range(3):
        lens = [10, 6, 5, 8]
        chose_groups = serve(caches, [(s, lens[s] + step) for s in range(4)], rng)
    assert chose_groups  # four private sequences decoding: the rule picks groups


def test_tokens_of_one_sequence_interleaved_with_others_are_grouped_back_in_order(rng):
    caches = trio()
    for _ in range(3):
        on_all(caches, "seq_new")
    serve(caches, [(0, 0), (1, 0), (0, 1), (2, 0), (1, 1), (0, 2), (2, 1)], rng)
    serve(caches, [(2, 2), (0, 3), (2, 3), (1, 2)], rng)


def test_forks_sharing_prefix_cells_agree_both_ways(rng):
    caches = trio()
    trunk = on_all(caches, "seq_new")
    serve(caches, prefill_chunk([9]), rng)
    on_all(caches, "seq_clone", trunk)
    on_all(caches, "seq_clone", trunk, 4)  # shares only positions < 4
    serve(caches, [(1, 9), (2, 4), (2, 5)], rng)
    for step in range(3):
        serve(caches, [(0, 9 + step), (1, 10 + step), (2, 6 + step)], rng)


def test_freed_cells_refilled_below_live_ones_agree_both_ways(rng):
    caches = trio()
    for _ in range(3):
        on_all(caches, "seq_new")
    serve(caches, prefill_chunk([4, 6, 3]), rng)
    on_all(caches, "seq_rm", 1)
    on_all(caches, "seq_new")
    serve(caches, [(1, 0), (1, 1), (0, 4), (2, 3)], rng)
    on_all(caches, "seq_rm", 0, 1, 3)  # a hole inside a sequence
    serve(caches, [(0, 5), (2, 4), (1, 2)], rng)


def test_float16_storage_is_gathered_then_computed_in_the_query_dtype(rng):
    caches = trio(kv_dtype="float16")
    for _ in range(2):
        on_all(caches, "seq_new")
    serve(caches, prefill_chunk([5, 3]), rng)
    serve(caches, [(0, 5), (1, 3)], rng)


def test_a_long_run_of_random_steps_agrees_both_ways(rng):
    caches = trio(capacity=512)
    live = {}
    for _ in range(12):
        if len(live) < 5 and rng.random() < 0.5:
            s = on_all(caches, "seq_new")
            live[s] = 0
        if live and rng.random() < 0.2:
            src = int(rng.choice(list(live)))
            dst = on_all(caches, "seq_clone", src)
            live[dst] = live[src]
        owners = [s for s in live for _ in range(int(rng.integers(1, 4)))]
        tokens = []
        for s in rng.permutation(owners).tolist():  # sequences interleaved, each one's positions rising
            tokens.append((s, live[s]))
            live[s] += 1
        if tokens:
            serve(caches, tokens, rng)


def test_the_rule_groups_many_private_sequences_and_keeps_one_sequence_dense():
    # 32 decoding sequences of 1k private cells each: 32 * 1024 * 2 pairs vs 32 * 32768
    assert choose("auto", 32, 32 * 1024, 32, 1, 1024)
    # one sequence's prefill chunk seeing every cell
    assert not choose("auto", 512, 2048, 1, 512, 2048)
    # four forks one token each, still sharing a 1k prefix of a 1.1k window
    assert not choose("auto", 4, 1100, 4, 1, 1025)
    assert grouped_cost(4, 1, 1025) == 8200 and dense_cost(4, 1100) == 4400
    assert choose("grouped", 1, 1, 1, 1, 1) and not choose("dense", 32, 32768, 32, 1, 1024)


def test_an_unknown_attention_path_is_refused():
    with pytest.raises(ConfigError, match="attention path 'sparse'"):
        plan_groups(np.array([0, 1]), np.eye(2, dtype=bool), "sparse")


def test_a_plan_pads_queries_with_the_last_token_and_keys_with_masked_cells():
    # tokens: seq 5 at cells 0, 1 (causal); seq 2 at cell 2; mask over 3 cells
    mask = np.array([[1, 0, 0], [1, 1, 0], [0, 0, 1]], dtype=bool)
    plan = plan_groups(np.array([5, 5, 2]), mask, "grouped")
    assert plan.tokens.tolist() == [[0, 1], [2, 2]]  # groups in order of appearance; seq 2 repeats its token
    assert plan.cells.tolist() == [[0, 1], [2, 0]]
    assert plan.out.tolist() == [0, 1, 2]
    assert plan.mask.tolist() == [[[[True, False], [True, True]]], [[[True, False], [True, False]]]]  # [G, 1, Qg, Kg]


def test_a_plan_of_equal_private_decodes_needs_no_mask():
    mask = np.kron(np.eye(3, dtype=bool), np.ones((1, 4), dtype=bool))  # 3 tokens, 4 private cells each
    plan = plan_groups(np.array([0, 1, 2]), mask)
    assert plan is not None and plan.mask is None
    assert plan.cells.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]


def test_a_plan_is_in_order_exactly_when_its_query_slots_are_the_step_s_tokens_in_order():
    private = np.kron(np.eye(3, dtype=bool), np.ones((1, 4), dtype=bool))  # 3 decodes, 4 private cells each
    assert plan_groups(np.array([0, 1, 2]), private, "grouped").in_order
    # widest first: sequence 0's 20000 cells run apart from the two short ones (padding them to it
    # would cost more than a batch: BATCH_PAIRS), still in token order
    ragged = np.zeros((3, 20010), dtype=bool)
    ragged[0, :20000], ragged[1, 20000:20005], ragged[2, 20005:] = True, True, True
    plan = plan_groups(np.array([0, 1, 2]), ragged, "grouped")
    assert len(plan.more) == 1 and plan.in_order
    # the short ones first: the batches' slots run [1, 2, 0], so `out` is needed
    plan = plan_groups(np.array([1, 2, 0]), ragged[[1, 2, 0]], "grouped")
    assert len(plan.more) == 1 and not plan.in_order
    # a padded query slot (sequence 2 has one token beside sequence 5's two), or tokens out of sequence order
    causal = np.array([[1, 0, 0], [1, 1, 0], [0, 0, 1]], dtype=bool)
    assert not plan_groups(np.array([5, 5, 2]), causal, "grouped").in_order
    out_of_order = np.array([[1, 0, 0], [0, 1, 0], [1, 0, 1]], dtype=bool)
    assert not plan_groups(np.array([0, 1, 0]), out_of_order, "grouped").in_order


def test_layers_of_one_window_share_one_grouping_each_with_its_own_pool():
    c = CellCache(
        CacheConfig(capacity=16, n_layers=2, layers=[LayerConfig(H_KV, D)], kv_dtype="float32"), make_plugin_manager()
    )
    c.attention_path = "grouped"
    a, b = c.as_batch_control().seq_new(), c.as_batch_control().seq_new()
    assert c.as_batch_control().declare_step([a, b])
    k = mx.zeros((1, H_KV, 2, D))
    s0, s1 = (c.update_and_fetch(layer, [0, 0], k, k) for layer in range(2))
    assert s0.groups.cells is s1.groups.cells and s0.groups.tokens is s1.groups.tokens
    assert s0.groups.keys.shape == (1, H_KV, c.key_pools[0].slots, D)  # the whole pool: the gather takes rows of it
    assert s0.mask is s1.mask and s0.keys.shape == (1, H_KV, 2, D)  # the dense fields stay as they were


def test_a_long_prefill_beside_decodes_is_split_into_query_blocks():
    # seq 0: 64 prompt tokens at cells 0..63 (causal); seqs 1..4: one decode token each over 100 own cells
    prefill = np.tril(np.ones((64, 64), dtype=bool))
    mask = np.zeros((68, 64 + 4 * 100 + 4), dtype=bool)
    mask[:64, :64] = prefill
    for i in range(4):
        mask[64 + i, 64 + 100 * i : 64 + 100 * (i + 1)] = True
        mask[64 + i, 464 + i] = True
    seq_ids = np.array([0] * 64 + [1, 2, 3, 4])
    plan = plan_groups(seq_ids, mask)
    assert plan is not None and plan.tokens.shape[1] < 64  # blocks, not one 64-query group padding the decodes
    # every token's slot holds it, and each group's cells cover what its tokens see
    flat_tokens = plan.tokens.reshape(-1)
    assert (flat_tokens[plan.out] == np.arange(68)).all()
    for g in range(plan.tokens.shape[0]):
        seen = mask[plan.tokens[g]].any(axis=0)
        assert set(np.flatnonzero(seen)) <= set(plan.cells[g].tolist())


def test_a_ragged_step_runs_as_several_batches_with_the_dense_result():
    # prompt chunks of several lengths beside one-token decodes, big enough that padding every
    # group to the widest costs more than an SDPA per batch (kvlayout_cell.groups.batch_groups)
    rng = np.random.default_rng(11)
    caches = trio(capacity=4096)
    seqs = [[c.as_batch_control().seq_new() for _ in range(5)] for c in caches.values()][0]
    held = dict.fromkeys(seqs, 0)
    batches = []
    for lengths in ([300, 40, 1, 1, 300], [1, 300, 40, 1, 1], [40, 1, 300, 1, 1]):
        tokens = []
        for s, n in zip(seqs, lengths):
            tokens += [(s, held[s] + i) for i in range(n)]
            held[s] += n
        specs = {}
        serve(caches, tokens, rng, specs)
        batches.append(1 + len(specs["grouped"][0].groups.more))
    assert max(batches) > 1


def test_plan_cells_agrees_with_plan_groups_on_what_each_token_sees():
    from kvlayout_cell.groups import plan_cells

    c = trio(capacity=2048)["dense"]
    seqs = [c.as_batch_control().seq_new() for _ in range(4)]
    held = dict.fromkeys(seqs, 0)
    for lengths in ([200, 3, 1, 90], [1, 1, 250, 7]):
        tokens = [(s, held[s] + i) for s, n in zip(seqs, lengths) for i in range(n)]
        for s, n in zip(seqs, lengths):
            held[s] += n
        ids, pos = np.array([s for s, _ in tokens]), np.array([p for _, p in tokens])
        assert c.as_batch_control().declare_step(ids)
        T = len(tokens)
        for layer, window in enumerate((0, 3, 5)):
            step = c.update_and_fetch(layer, pos, mx.zeros((1, H_KV, T, D)), mx.zeros((1, H_KV, T, D)))
            mask = np.array(step.mask)[0, 0]  # [T, read_len]
            for plan in (
                plan_groups(ids, mask, "grouped"),
                # each layer plans over its own layer group's table (a ring's: its window's cells only)
                plan_cells(ids, pos, window, mask.shape[1], c.groups.stepper_of(layer).table.seq_keys, "grouped"),
            ):
                batches = [(b.tokens, b.cells, b.mask) for b in plan.batches()]
                seen = np.zeros_like(mask)
                slots = []
                for tok, cells, m in batches:
                    m = np.ones(tok.shape + cells.shape[1:], dtype=bool) if m is None else m[:, 0]  # [G, Qg, Kg]
                    for g in range(tok.shape[0]):
                        for i in range(tok.shape[1]):
                            seen[tok[g, i], cells[g][m[g, i]]] = True
                    slots.append(tok.reshape(-1))
                np.testing.assert_array_equal(seen, mask)
                assert (np.concatenate(slots)[plan.out] == np.arange(T)).all()


def test_a_grouped_step_builds_its_dense_mask_only_when_read_even_after_the_table_moved_on():
    caches = trio(capacity=64)
    for c in caches.values():
        a, b = c.as_batch_control().seq_new(), c.as_batch_control().seq_new()
        assert c.as_batch_control().declare_step([a, a, b])
        for layer in range(len(LAYERS)):
            c.update_and_fetch(layer, [0, 1, 0], mx.zeros((1, H_KV, 3, D)), mx.zeros((1, H_KV, 3, D)))
    specs = {}
    for path, c in caches.items():
        assert c.as_batch_control().declare_step([a, b])
        specs[path] = c.update_and_fetch(0, [2, 1], mx.zeros((1, H_KV, 2, D)), mx.zeros((1, H_KV, 2, D)))
        assert (specs[path].groups is not None) == (path in ("grouped", "paged"))
        for layer in range(1, len(LAYERS)):  # the forward's other layers (layer 0's spec is the one read below)
            c.as_cell_stepper().place_step(layer, [2, 1])
    built = []
    table = caches["grouped"].groups.primary.table
    visible = table.visible
    # Records the positions of every dense mask built from the table: this step's are [2, 1].
    table.visible = lambda seq_ids, positions, *a: built.append(positions.tolist()) or visible(seq_ids, positions, *a)
    for c in caches.values():  # the step ends and the table moves on before anyone reads the mask
        c.as_batch_control().seq_rm(a, 1)
        assert c.as_batch_control().declare_step([b])
        c.update_and_fetch(0, [2], mx.zeros((1, H_KV, 1, D)), mx.zeros((1, H_KV, 1, D)))
    want = np.array(specs["dense"].mask)
    # b continued after its cell 2 into 3; a, whose next cell was b's, took the lowest free, 4
    assert want[0, 0].tolist() == [[True, True, False, False, True], [False, False, True, True, False]]
    assert [2, 1] not in built  # the grouped path never built this step's dense mask
    np.testing.assert_array_equal(np.array(specs["grouped"].mask), want)  # built now, from the cells as they were
    assert built.count([2, 1]) == 1


def test_page_batch_reads_the_pages_a_group_fills_and_gathers_the_rest():
    # pool of 32 slots; one query per group. Group 0: cells 0-15 and 20; group 1: cells 16-19 and 21-31.
    cells = np.array([list(range(16)) + [20], list(range(16, 20)) + list(range(21, 32)) + [0, 0]])
    mask = np.zeros((2, 1, 17), dtype=bool)
    mask[0, 0, :] = True
    mask[1, 0, :15] = True  # group 1's padding is masked
    # A page of 16 is kept when 2 * held > 16 + PAGE_PAIRS (8): held 16 (group 0) and 15 (group 1) are,
    # cell 20 alone is not; no group fills half a page of 32. Cost 2 * (1 * 24 + 1 * 2) = 52 < gathered 2 * 17 * 2.
    size, pages, tail, paged = page_batch(cells, mask, np.array([17, 15]), 32)
    assert size == 16 and pages.tolist() == [[0], [1]]
    assert tail.tolist() == [[20], [0]]  # group 1 has no tail: a masked padding cell
    assert paged.shape == (2, 1, 16 + 1)
    assert np.flatnonzero(paged[0, 0]).tolist() == list(range(17))
    # group 1 in page 1 (cells 16-31): not cell 20 (slot 4, group 0's), not its tail's padding (slot 16)
    assert np.flatnonzero(paged[1, 0]).tolist() == [0, 1, 2, 3] + list(range(5, 16))


def test_auto_reads_long_private_runs_by_pages_and_scattered_cells_by_gathering():
    # two decodes over 64 private cells each, in runs of 64: pages of 64 cost 2 * (64 + 8) < 2 * 64 * 2
    cells = np.stack([np.arange(64), np.arange(64, 128)])
    mask = np.ones((2, 1, 64), dtype=bool)
    size, pages, tail, paged = page_batch(cells, mask, np.array([64, 64]), 128)
    assert size == 64 and pages.tolist() == [[0], [1]] and tail is None and paged.all()
    # the same counts interleaved cell by cell: any page is half foreign, gathering is cheaper
    assert page_batch(np.stack([np.arange(0, 128, 2), np.arange(1, 128, 2)]), mask, np.array([64, 64]), 128) is None


def test_the_forced_paged_path_reads_half_full_pages_where_a_size_tiles_the_pool():
    cells, mask = np.array([[0, 1, 5]]), np.ones((1, 1, 3), dtype=bool)
    # pages of 8 hold 3 of 8 (not kept); of 4: page 0 holds 2 of 4 (kept), page 1 one (gathered)
    size, pages, tail, paged = page_batch(cells, mask, np.array([3]), 8, "paged")
    assert (size, pages.tolist(), tail.tolist()) == (4, [[0]], [[5]])
    assert np.flatnonzero(paged[0, 0]).tolist() == [0, 1, 4]
    assert page_batch(cells, mask, np.array([3]), 8) is None  # "auto": gathering 3 cells is cheaper
    assert page_batch(cells, mask, np.array([3]), 10, "paged") is None  # no page size tiles 10 slots


@pytest.mark.parametrize("h_kv, d", [(2, 128), (3, 64)])
@pytest.mark.parametrize("kv_dtype", ["float32", "float16"])
def test_sequences_prefilled_in_turns_decode_by_pages_with_the_dense_result(rng, kv_dtype, h_kv, d):
    # Four sequences, 64-token chunks written in turn (the default placement continues each
    # sequence's second chunk in its page: each owns one aligned page of PLACEMENT_PAGE = 128 cells),
    # over rows of H_kv * D = 256 or 192 elements (SmolLM2's): "auto" reads the decode step by pages,
    # as "paged" does -- in float32; float16 storage, which the CPU's gather_mm cannot read, "auto" gathers.
    config = CacheConfig(capacity=1024, n_layers=1, layers=[LayerConfig(h_kv, d)], kv_dtype=kv_dtype, max_seqs=8)
    caches = {path: CellCache(config, make_plugin_manager()) for path in ("dense", "paged", "auto")}
    for path, c in caches.items():
        c.attention_path = path
    seqs = [on_all(caches, "seq_new") for _ in range(4)]
    for start in (0, 64):
        for s in seqs:
            kv = mx.array(rng.normal(size=(1, h_kv, 64, d)).astype(np.float32))
            for c in caches.values():
                assert c.as_batch_control().declare_step([s] * 64)
                c.update_and_fetch(0, list(range(start, start + 64)), kv, -kv)
    q = mx.array(rng.normal(size=(1, 2 * h_kv, 4, d)).astype(np.float32))
    kv = mx.array(rng.normal(size=(1, h_kv, 4, d)).astype(np.float32))
    outs = {}
    for path, c in caches.items():
        assert c.as_batch_control().declare_step(seqs)
        spec = c.update_and_fetch(0, [128] * 4, kv, -kv)
        assert (spec.groups is None) == (path == "dense")
        if spec.groups is not None:
            paged = path == "paged" or kv_dtype == "float32"
            pages = [b.page for b in spec.groups.batches()]
            # the tail, when paged: + the new token
            assert pages == ([PLACEMENT_PAGE] if paged else [0]) and (spec.groups.tail is not None) == paged
        outs[path] = np.array(attend(q, spec, d**-0.5))
    for path in ("paged", "auto"):
        np.testing.assert_allclose(outs[path], outs["dense"], atol=1e-5, rtol=1e-5)


def test_auto_pages_only_one_query_groups_over_wide_rows():
    from kvlayout_cell.groups import plan_cells

    # the same four sequences of two 64-cell runs each, decoding one token (cells 512-515)
    cells = {s: np.r_[np.arange(64 * s, 64 * s + 64), np.arange(256 + 64 * s, 256 + 64 * s + 64), 512 + s]
             for s in range(4)}

    def owned(ids):
        c = np.concatenate([cells[int(i)] for i in ids])
        return c, np.concatenate([np.arange(129)] * len(ids)), np.arange(len(ids) + 1) * 129

    ids, pos = np.arange(4), np.full(4, 128)
    wide = plan_cells(ids, pos, 0, 516, owned, "auto", pool=(1024, 128))  # 2 x 64: paged from here on
    narrow = plan_cells(ids, pos, 0, 516, owned, "auto", pool=(1024, 127))  # 1 x 32 and the like: gathered
    assert wide.page == 64 and narrow.page == 0 and narrow.tail is None
    # two tokens each (positions 127 and 128): groups of two queries are gathered, however wide the row
    two = plan_cells(np.repeat(ids, 2), np.tile([127, 128], 4), 0, 516, owned, "auto", pool=(1024, 1024))
    assert two.tokens.shape == (4, 2) and two.page == 0 and not two.more


def test_every_path_was_exercised_by_pages():
    # over this module's steps the forced path read pages, with and without a tail, and "grouped" never did
    assert PAGED["paged"] > TAILS["paged"] > 0 and PAGED["grouped"] == 0


def lone_token_specs(caches, token, rng):
    """Per layer, whether `auto` gave a one-token step `(seq, pos)` no mask, and whether the
    oracle says it sees every cell below read_len; every path agreeing on the output."""
    served = {}
    serve(caches, [token], rng, served)
    specs = served["auto"]
    seq, pos = token
    return [
        (spec.mask_kind is MaskKind.NONE,
         LAYERS[layer].policy.kind != "ring" and sees_every_cell(caches["auto"], layer, seq, pos))
        for layer, spec in enumerate(specs)
    ]


def sees_every_cell(cache, layer, seq, pos) -> bool:
    """Oracle: the token sees each cell below used_end, by the plain-Python rule over the table."""
    cells, positions, owners = cache.as_cell_view().cell_owners()
    held = {int(c): (int(p), bool(o[seq])) for c, p, o in zip(cells, positions, owners)}
    window = LAYERS[layer].policy.window if LAYERS[layer].policy.kind == "ring" else 0
    return all(
        c in held and held[c][1] and held[c][0] <= pos and (window == 0 or held[c][0] > pos - window)
        for c in range(cache.as_batch_control().used_end)
    )


def test_a_lone_token_attends_with_no_mask_exactly_when_it_sees_every_cell_below_read_len(rng):
    caches = trio()
    a = on_all(caches, "seq_new")
    serve(caches, prefill_chunk([6]), rng)
    cases = [lone_token_specs(caches, (a, 6), rng)]  # alone and whole: every flat cell is its own
    b = on_all(caches, "seq_new")
    serve(caches, [(b, 0)], rng)
    cases.append(lone_token_specs(caches, (a, 7), rng))  # another sequence's cell below read_len
    on_all(caches, "seq_rm", b)
    on_all(caches, "seq_rm", a, 2, 3)
    cases.append(lone_token_specs(caches, (a, 8), rng))  # a hole in its own cells
    on_all(caches, "seq_rm", a)
    a = on_all(caches, "seq_new")
    serve(caches, prefill_chunk([3]), rng)
    cases.append(lone_token_specs(caches, (a, 3), rng))  # alone and whole again, in fresh cells
    for per_layer in cases:
        for none, oracle in per_layer:
            assert none is oracle
    assert [per_layer[0][0] for per_layer in cases] == [True, False, False, True]  # the flat layer


def test_a_chunk_of_one_sequence_owning_every_cell_is_causal_in_order_and_masked_on_the_device_otherwise(rng):
    caches = trio(capacity=5)  # five cells: what a sequence adds after a hole goes into the hole
    a = on_all(caches, "seq_new")
    served = {}
    serve(caches, prefill_chunk([5]), rng, served)  # cells 0-4 hold positions 0-4: causal
    specs = served["auto"]
    assert specs[0].mask_kind is MaskKind.CAUSAL and specs[0].mask is None
    assert [s.mask_kind for s in specs[1:]] == [MaskKind.EXPLICIT] * 2  # the rings keep their masks
    on_all(caches, "seq_rm", a, 1, 3)  # positions 1-2 go: cells 1 and 2 free below live ones
    served = {}
    serve(caches, [(a, 5), (a, 6)], rng, served)  # into cells 1 and 2: positions out of cell order
    specs = served["auto"]
    cells, positions, owners = caches["auto"].as_cell_view().cell_owners()
    assert cells.tolist() == [0, 1, 2, 3, 4] and positions.tolist() == [0, 5, 6, 3, 4] and owners[:, a].all()
    flat = specs[0]
    assert flat.mask_kind is MaskKind.EXPLICIT and flat.groups is None
    # The plain-Python rule: token i (position 5 + i) sees cell c iff c's position is not newer.
    want = [[p <= 5 + i for p in positions.tolist()] for i in range(2)]
    assert np.array(flat.mask)[0, 0].tolist() == want


@pytest.mark.parametrize("lengths", [[9, 3, 14, 6, 1], [5, 5, 5, 5, 5]])  # ragged, and equal: no mask at all
def test_decode_steps_continue_the_last_grouping_with_the_dense_result(rng, lengths):
    # Ragged sequences decoding in step after step: every path but dense continues the last step's grouping
    # (kvlayout_cell.continued) on the flat layer, planning it whole again after a verb, a step of other
    # sequences or REPLAN_EVERY steps; every step's output is the dense mask's (serve compares them).
    from kvlayout_cell.continued import REPLAN_EVERY

    caches = trio(capacity=1024)
    seqs = [on_all(caches, "seq_new") for _ in range(5)]
    serve(caches, prefill_chunk(lengths), rng)
    for _ in range(REPLAN_EVERY + 6):  # past a full re-plan
        serve(caches, [(s, lengths[s]) for s in seqs], rng)
        lengths = [n + 1 for n in lengths]
    counts = {path: dict(c.grouping_counts) for path, c in caches.items()}
    fork = on_all(caches, "seq_clone", seqs[2])  # a verb: the next step is planned whole
    lengths.append(lengths[2])
    for _ in range(4):
        serve(caches, [(s, lengths[s]) for s in [*seqs, fork]], rng)
        lengths = [n + 1 for n in lengths]
    on_all(caches, "seq_rm", seqs[0])
    for _ in range(3):
        serve(caches, [(s, lengths[s]) for s in [*seqs[1:], fork]], rng)
        lengths = [n + 1 for n in lengths]
    for path in ("grouped", "paged", "auto"):
        got = caches[path].grouping_counts
        # a flat layer per step: the first decode step and one every REPLAN_EVERY planned, the rest continued
        assert counts[path]["continued"] == REPLAN_EVERY + 6 - 2
        assert got["continued"] - counts[path]["continued"] == 3 + 2  # the step after each verb is planned
    assert caches["dense"].grouping_counts["continued"] == 0  # dense steps have no grouping to continue


@pytest.mark.parametrize("path", ["paged", "auto"])
def test_decode_steps_by_pages_continue_through_page_ends_with_the_dense_result(rng, path):
    # Rows of 2 x 128 (auto pages them): four sequences prefilled in 64-token turns, then decoding past the
    # end of their page (position 128 on, PLACEMENT_PAGE = 128): new cells land in pages the groups read and
    # in their gathered tails, and a group at its tail's end widens it; every step is the dense result.
    h_kv, d = 2, 128
    config = CacheConfig(capacity=2048, n_layers=1, layers=[LayerConfig(h_kv, d)], kv_dtype="float32", max_seqs=8)
    caches = {p: CellCache(config, make_plugin_manager()) for p in ("dense", path)}
    for p, c in caches.items():
        c.attention_path = p
    seqs = [on_all(caches, "seq_new") for _ in range(4)]
    for start in (0, 64):
        for s in seqs[: 3 if start else 4]:  # the last stays short: groups of unequal tails
            kv = mx.array(rng.normal(size=(1, h_kv, 64, d)).astype(np.float32))
            for c in caches.values():
                assert c.as_batch_control().declare_step([s] * 64)
                c.update_and_fetch(0, list(range(start, start + 64)), kv, -kv)
    ends = [128, 128, 128, 64]
    for _ in range(40):
        q = mx.array(rng.normal(size=(1, 2 * h_kv, 4, d)).astype(np.float32))
        kv = mx.array(rng.normal(size=(1, h_kv, 4, d)).astype(np.float32))
        outs = {}
        for p, c in caches.items():
            assert c.as_batch_control().declare_step(seqs)
            outs[p] = np.array(attend(q, c.update_and_fetch(0, ends, kv, -kv), d**-0.5))
        np.testing.assert_allclose(outs[path], outs["dense"], atol=1e-5, rtol=1e-5)
        ends = [e + 1 for e in ends]
    assert caches[path].grouping_counts["continued"] >= 30


def test_a_grouped_specs_dense_fields_read_late_are_its_steps_own(rng):
    # A grouped spec makes its dense keys, values and mask only when read. Read after later steps wrote into
    # the cells it read (a sequence removed, its cells refilled), they are still this step's: the dense path's
    # spec of the same step, whose fields were read at once, is the oracle.
    caches = trio()
    for _ in range(3):
        on_all(caches, "seq_new")
    serve(caches, prefill_chunk([6, 3, 5]), rng)
    specs = {}
    serve(caches, [(0, 6), (1, 3), (2, 5)], rng, specs)
    on_all(caches, "seq_rm", 0)  # its seven cells are free again, below that step's read_len
    refill = on_all(caches, "seq_new")
    serve(caches, [(refill, i) for i in range(7)], rng)
    serve(caches, [(1, 4), (2, 6), (refill, 7)], rng)
    oracle = specs["dense"][0]  # the flat layer of the step before
    for path in ("grouped", "paged"):
        late = specs[path][0]
        assert late.groups is not None and oracle.groups is None
        for field in ("keys", "values", "mask"):
            assert np.array_equal(np.array(getattr(late, field)), np.array(getattr(oracle, field))), (path, field)
