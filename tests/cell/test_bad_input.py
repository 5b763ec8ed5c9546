"""Bad input to every verb of the cell layout: a KVLayoutError naming the argument, nothing changed.

The cache under test holds three sequences sharing a prefix and has a step
declared (or declared and placed on layer 0). Every row calls one entry point
with one bad argument; afterwards every observable number (free cells,
used_end, each id's seq_len and next_pos, every pool byte) is as before, and
the standing step can still be served, which shows the declaration survived.
"""

from __future__ import annotations

import math
import re

import mlx.core as mx
import numpy as np
import pytest

from kvlayout import CacheConfig, LayerConfig, LayerPolicy
from kvlayout.errors import ConfigError, KVLayoutError, SequenceError, StateError, StepError
from kvlayout.hookspecs import hookimpl
from kvlayout.registry import make_plugin_manager
from kvlayout_cell.cache import CellCache
from kvlayout_cell.table import CellTable

H, D = 2, 4
WINDOWS = (0, 2, 0)  # flat, ring of 2, flat
MAX_SEQS = 4
NEXT = [4, 4]  # the declared step: one token each for ids 0 and 1, at their next positions


def kv(T, seed=0, dtype=mx.float32, heads=H, dim=D):
    rng = np.random.default_rng(seed)
    return mx.array(rng.normal(size=(1, heads, T, dim)).astype(np.float32)).astype(dtype)


def make(phase: str, pm=None) -> CellCache:
    """ids 0 (positions 0..3), 1 (shares 0..1, owns 2..3), 2 (live, empty); 3 not live.

    phase "declared": a step for ids [0, 1] is declared; "placed": layer 0 has
    served it too; "none": no step declared.
    """
    layers = [LayerConfig(H, D, LayerPolicy("ring", w) if w else LayerPolicy()) for w in WINDOWS]
    c = CellCache(
        CacheConfig(capacity=16, n_layers=3, layers=layers, kv_dtype="float32", initial_capacity=4, max_seqs=MAX_SEQS),
        make_plugin_manager() if pm is None else pm,
    )
    bc = c.as_batch_control()
    s0 = bc.seq_new()
    assert bc.declare_step([s0] * 4)
    for layer in range(3):
        c.update_and_fetch(layer, [0, 1, 2, 3], kv(4, 1), kv(4, 2))
    s1 = bc.seq_clone(s0, upto=2)
    assert bc.declare_step([s1, s1])
    for layer in range(3):
        c.update_and_fetch(layer, [2, 3], kv(2, 3), kv(2, 4))
    assert bc.seq_new() == 2
    if phase != "none":
        assert bc.declare_step([0, 1])
    if phase == "placed":
        c.update_and_fetch(0, NEXT, kv(2, 5), kv(2, 6))
    return c


def state(c: CellCache) -> dict:
    """Everything a caller can observe, pools as numpy."""
    bc = c.as_batch_control()
    return dict(
        free=bc.free_cells,
        used_end=bc.used_end,
        can_extend=[bc.can_extend(n) for n in range(bc.capacity + 2)],
        ids=[(bc.seq_len(s), bc.next_pos(s)) for s in range(bc.max_seqs)],
        slots=[p.slots for p in c.key_pools + c.value_pools],
        pools=[np.array(p.read(0, p.slots)) for p in c.key_pools + c.value_pools],
    )


def assert_same(a: dict, b: dict) -> None:
    assert {k: v for k, v in a.items() if k != "pools"} == {k: v for k, v in b.items() if k != "pools"}
    for x, y in zip(a["pools"], b["pools"], strict=True):
        np.testing.assert_array_equal(x, y)


def finish(c: CellCache, phase: str) -> None:
    """Serve the standing step's remaining layers: the refusal left the declaration in place."""
    bc = c.as_batch_control()
    if phase == "none":
        return
    for layer in range(1 if phase == "placed" else 0, c.n_layers):
        spec = c.update_and_fetch(layer, NEXT, kv(2, 5), kv(2, 6))
        assert spec.keys.shape[2] == c.groups.stepper_of(layer).table.used_end  # its layer group's cells
    assert [bc.next_pos(0), bc.next_pos(1)] == [5, 5]


HUGE = 2**70
BIG = 2**62
U64 = 2**63

# entry point -> rows: (id, phase, args, error, regex the message must match)
VERBS = {
    "seq_clone": [
        ("src a string", ("0",), SequenceError, "src='0'"),
        ("src a float", (0.0,), SequenceError, "src=0.0"),
        ("src NaN", (math.nan,), SequenceError, "src=nan"),
        ("src None", (None,), SequenceError, "src=None"),
        ("src a bool", (True,), SequenceError, "src=True"),
        ("src negative", (-1,), SequenceError, "src=-1"),
        ("src past max_seqs", (MAX_SEQS,), SequenceError, "src=4"),
        ("src 2**62", (BIG,), SequenceError, f"src={BIG}"),
        ("src 2**70", (HUGE,), SequenceError, f"src={HUGE}"),
        ("src not live", (3,), SequenceError, "src=3"),
        ("upto negative", (0, -1), SequenceError, "upto=-1"),
        ("upto a float", (0, 2.0), SequenceError, "upto=2.0"),
        ("upto inf", (0, math.inf), SequenceError, "upto=inf"),
        ("upto a string", (0, "2"), SequenceError, "upto='2'"),
        ("upto a numpy float", (0, np.float64(2)), SequenceError, "upto="),
    ],
    "seq_rm": [
        ("id a string", ("0",), SequenceError, "seq_id='0'"),
        ("id NaN", (math.nan,), SequenceError, "seq_id=nan"),
        ("id None", (None,), SequenceError, "seq_id=None"),
        ("id negative", (-1,), SequenceError, "seq_id=-1"),
        ("id 2**70", (HUGE,), SequenceError, f"seq_id={HUGE}"),
        ("id not live", (3,), SequenceError, "seq_id=3"),
        ("p0 negative", (0, -1), SequenceError, "p0=-1"),
        ("p0 a float", (0, 1.0), SequenceError, "p0=1.0"),
        ("p0 NaN", (0, math.nan), SequenceError, "p0=nan"),
        ("p0 None", (0, None), SequenceError, "p0=None"),
        ("p1 below p0", (0, 3, 2), SequenceError, "p1=2"),
        ("p1 negative", (0, 0, -1), SequenceError, "p1=-1"),
        ("p1 inf", (0, 0, math.inf), SequenceError, "p1=inf"),
        ("p1 a string", (0, 0, "4"), SequenceError, "p1='4'"),
    ],
    "seq_len": [
        ("id a float", (0.0,), SequenceError, "seq_id=0.0"),
        ("id negative", (-1,), SequenceError, "seq_id=-1"),
        ("id past max_seqs", (MAX_SEQS,), SequenceError, "seq_id=4"),
        ("id 2**70", (HUGE,), SequenceError, f"seq_id={HUGE}"),
        ("id None", (None,), SequenceError, "seq_id=None"),
    ],
    "next_pos": [
        ("id NaN", (math.nan,), SequenceError, "seq_id=nan"),
        ("id a string", ("1",), SequenceError, "seq_id='1'"),
        ("id 2**62", (BIG,), SequenceError, f"seq_id={BIG}"),
    ],
    "can_extend": [
        ("n negative", (-1,), StepError, "n=-1"),
        ("n a float", (1.0,), StepError, "n=1.0"),
        ("n NaN", (math.nan,), StepError, "n=nan"),
        ("n None", (None,), StepError, "n=None"),
        ("n a string", ("1",), StepError, "n='1'"),
    ],
    "declare_step": [
        ("empty", ([],), StepError, "seq_ids is empty"),
        ("None", (None,), SequenceError, "seq_ids"),
        ("a string", ("01",), SequenceError, "seq_ids"),
        ("an int", (0,), SequenceError, "seq_ids"),
        ("2-d", ([[0, 1]],), SequenceError, "seq_ids"),
        ("floats", ([0.0, 1.0],), SequenceError, "seq_ids"),
        ("NaN", (np.array([0, np.nan]),), SequenceError, "seq_ids"),
        ("inf", ([0, math.inf],), SequenceError, "seq_ids"),
        ("bools", ([True, False],), SequenceError, "seq_ids"),
        ("mlx floats", (mx.array([0.0]),), SequenceError, "seq_ids"),
        ("negative id", ([0, -1],), SequenceError, r"seq_ids\[1\]=-1"),
        ("id past max_seqs", ([0, MAX_SEQS],), SequenceError, r"seq_ids\[1\]=4"),
        ("id 2**62", ([BIG],), SequenceError, rf"seq_ids\[0\]={BIG}"),
        ("id 2**63", ([U64],), SequenceError, rf"seq_ids.*(?<!-)\b{U64}\b"),
        ("id 2**63 as uint64", (np.array([U64], dtype=np.uint64),), SequenceError, rf"seq_ids.*(?<!-)\b{U64}\b"),
        ("id 2**70", ([HUGE],), SequenceError, rf"seq_ids.*{HUGE}"),
        ("id not live", ([0, 3],), SequenceError, r"seq_ids\[1\]=3"),
    ],
    "place_step": [
        ("layer a string", ("0", NEXT), StepError, "layer='0'"),
        ("layer a float", (0.0, NEXT), StepError, "layer=0.0"),
        ("layer None", (None, NEXT), StepError, "layer=None"),
        ("layer negative", (-1, NEXT), StepError, "layer=-1"),
        ("layer past n_layers", (3, NEXT), StepError, "layer=3"),
        ("layer 2**70", (HUGE, NEXT), StepError, f"layer={HUGE}"),
        ("positions empty", (0, []), StepError, r"0 position\(s\)"),
        ("positions miscounted", (0, [4]), StepError, r"1 position\(s\)"),
        ("positions None", (0, None), StepError, "positions"),
        ("positions a string", (0, "44"), StepError, "positions"),
        ("positions an int", (0, 4), StepError, "positions"),
        ("positions 2-d", (0, [NEXT]), StepError, "positions"),
        ("positions floats", (0, [4.0, 4.0]), StepError, "positions"),
        ("positions NaN", (0, np.array([4, np.nan])), StepError, "positions"),
        ("positions inf", (0, [4, math.inf]), StepError, "positions"),
        ("positions bools", (0, [True, True]), StepError, "positions"),
        ("positions mlx floats", (0, mx.array([4.0, 4.0])), StepError, "positions"),
        ("positions negative", (0, [-1, 4]), StepError, r"positions\[0\]=-1"),
        ("positions not newer", (0, [3, 4]), StepError, r"positions\[0\]=3"),
        ("positions 2**63", (0, [U64, U64 + 1]), StepError, rf"positions.*(?<!-)\b{U64}\b"),
        (
            "positions 2**63 as uint64",
            (0, np.array([U64, U64], dtype=np.uint64)),
            StepError,
            rf"positions.*(?<!-)\b{U64}\b",
        ),
        ("positions 2**70", (0, [HUGE, HUGE]), StepError, rf"positions.*{HUGE}"),
    ],
}

PLACED = {  # refusals once layer 0 has placed the step
    "place_step": [
        ("layer served twice", (0, NEXT), StepError, "layer 0 was already served"),
        ("positions differ from the placed ones", (2, [5, 5]), StepError, r"positions \[5, 5\]"),
        ("positions floats", (1, [4.0, 4.0]), StepError, "positions"),
    ],
}

NONE = {  # refusals with no step declared
    "place_step": [("undeclared", (0, NEXT), StepError, "no step declared")],
}

ROWS = [
    pytest.param(
        phase, verb, args, error, message, id=f"{verb}: {name}" + ("" if phase == "declared" else f" ({phase})")
    )
    for phase, table in (("declared", VERBS), ("placed", PLACED), ("none", NONE))
    for verb, rows in table.items()
    for name, args, error, message in rows
] + [
    pytest.param(  # layer 1 is the ring's layer group, which places the step itself on its first layer
        "placed", "place_step", (1, [5, 5]), StepError, r"positions \[5, 5\]",
        id="place_step: positions differ from the placed ones, in another layer group (placed)",
    ),
]


@pytest.mark.parametrize("phase, verb, args, error, message", ROWS)
def test_a_bad_argument_is_refused_by_name_and_changes_nothing(phase, verb, args, error, message):
    c = make(phase)
    before = state(c)
    target = c.as_cell_stepper() if verb == "place_step" else c.as_batch_control()  # the faces' verbs, each its own
    with pytest.raises(error) as info:
        getattr(target, verb)(*args)
    assert isinstance(info.value, KVLayoutError)
    assert re.search(message, str(info.value)), str(info.value)
    assert_same(state(c), before)
    finish(c, phase)


# -- verbs in the middle of a forward -----------------------------------------------------------

# Layer 0 has served the step, layers 1 and 2 not yet. Each verb, with good arguments, would end
# the step with K/V that layers 1 and 2 never wrote in its cells (read as zeros ever after), so it
# is refused; the forward then goes on. clear() is the one verb that goes ahead (it aborts first).
MID_FORWARD = {
    "seq_new": lambda c, d: c.as_batch_control().seq_new(),
    "seq_clone": lambda c, d: c.as_batch_control().seq_clone(0),
    "seq_clone upto": lambda c, d: c.as_batch_control().seq_clone(1, 2),
    "seq_rm of another sequence": lambda c, d: c.as_batch_control().seq_rm(2),
    "seq_rm of the step's own positions": lambda c, d: c.as_batch_control().seq_rm(0, 4),
    "declare_step": lambda c, d: c.as_batch_control().declare_step([0, 1]),
    "declare_step past the free cells": lambda c, d: c.as_batch_control().declare_step([2] * 16),
    "declare_step with a bad id": lambda c, d: c.as_batch_control().declare_step([3]),
    "seq_rm of a sequence sharing the step's cells": lambda c, d: c.as_batch_control().seq_rm(1),
    "load_seq": lambda c, d: c.load_seq(d / "one.kv"),
    "the stepper's place_sequence (what load_seq does)": lambda c, d: c.groups.place_sequence([[0, 1]], [0]),
    "the stepper's restore (what kvlayout.load does)": lambda c, d: c.groups.primary.restore(
        *c.groups.primary.table.occupied(), c.groups.primary.table.live_ids(), StateError),
    "save": lambda c, d: c.save(d / "all.kv"),
    "save_seq": lambda c, d: c.save_seq(0, d / "seq.kv"),
}


@pytest.mark.parametrize("call", MID_FORWARD.values(), ids=MID_FORWARD.keys())
def test_a_verb_in_the_middle_of_a_forward_is_refused_and_changes_nothing(tmp_path, call):
    make("none").save_seq(0, tmp_path / "one.kv")
    c = make("placed")
    before = state(c)
    with pytest.raises(StepError, match=r"during a forward: layer\(s\) \[[12, ]+\]"):  # exact list: below
        call(c, tmp_path)
    assert_same(state(c), before)
    assert [p.name for p in tmp_path.iterdir()] == ["one.kv"]  # nothing written
    finish(c, "placed")


CACHE_VERBS = {k: v for k, v in MID_FORWARD.items() if "stepper's restore" not in k}  # a Stepper numbers its own


@pytest.mark.parametrize("call", CACHE_VERBS.values(), ids=CACHE_VERBS.keys())
def test_a_mid_forward_refusal_names_every_layer_not_served(tmp_path, call):
    make("none").save_seq(0, tmp_path / "one.kv")
    with pytest.raises(StepError, match=r"during a forward: layer\(s\) \[1, 2\]"):
        call(make("placed"), tmp_path)


def test_a_forward_is_not_done_until_every_layer_group_served_it():
    c = make("placed")
    c.update_and_fetch(2, NEXT, kv(2, 5), kv(2, 6))  # the flat group's other layer; the ring's not yet
    before = state(c)
    with pytest.raises(StepError, match=r"during a forward: layer\(s\) \[1\]"):
        c.as_batch_control().seq_new()
    assert_same(state(c), before)


class Seen:
    """Records the steps announced placed and aborted."""

    def __init__(self):
        self.placed, self.aborted = [], []

    @hookimpl
    def kvlayout_step_placed(self, step, window):
        self.placed.append(step)

    @hookimpl
    def kvlayout_step_aborted(self, step, window):
        self.aborted.append(step)


@pytest.mark.parametrize("phase", ["placed", "declared", "none"])
def test_clear_in_the_middle_of_a_forward_aborts_the_step_then_clears(phase):
    pm = make_plugin_manager()
    seen = Seen()
    pm.register(seen)
    c = make(phase, pm)
    bc = c.as_batch_control()
    placed = list(seen.placed)
    bc.clear()
    fresh = make("none")
    fresh.as_batch_control().clear()
    assert {k: v for k, v in state(c).items() if k != "pools"} == {
        k: v for k, v in state(fresh).items() if k != "pools"
    }
    # Only a half-served step is taken back, and its observers hear it; a complete one is not.
    assert seen.aborted == (placed[-1:] if phase == "placed" else [])
    assert c.abort_step() is False and c.groups.unserved_layers() == []
    s = bc.seq_new()
    assert bc.declare_step([s])
    for layer in range(c.n_layers):
        c.update_and_fetch(layer, [0], kv(1), kv(1))
    assert (bc.free_cells, bc.used_end) == (15, 1)


# -- the cache's views of the open step, its settings, its plugin manager -----------------------


def served(c):
    return c.groups.served_step(0)  # layer 0's CellStep: the "placed" phase served layer 0 only


STEP_VIEWS = {  # (call on a "placed" cache, what the message names)
    "layer None": (lambda c, view: view(None, served(c)), "layer=None"),
    "layer a string": (lambda c, view: view("0", served(c)), "layer='0'"),
    "layer negative": (lambda c, view: view(-1, served(c)), "layer=-1"),
    "layer past n_layers": (lambda c, view: view(3, served(c)), "layer=3"),
    "layer 2**70": (lambda c, view: view(HUGE, served(c)), f"layer={HUGE}"),
    "step None": (lambda c, view: view(0, None), "step=None"),
    "step a string": (lambda c, view: view(0, "step"), "step='step'"),
    "a layer the step has not served": (lambda c, view: view(1, served(c)), "step=.*layer 1"),
}


@pytest.mark.parametrize("view", ["step_groups", "step_mask"])
@pytest.mark.parametrize("call, message", STEP_VIEWS.values(), ids=STEP_VIEWS.keys())
def test_a_bad_step_view_is_refused_by_name_and_changes_nothing(view, call, message):
    c = make("placed")
    before = state(c)
    with pytest.raises(StepError, match=message):
        call(c, getattr(c, view))
    assert_same(state(c), before)
    getattr(c, view)(0, served(c))  # the right step: its grouping (None: dense) or its mask
    finish(c, "placed")


@pytest.mark.parametrize("view", ["step_groups", "step_mask"])
def test_a_step_view_of_an_earlier_forward_is_refused(view):
    # step_groups planned the open step's tokens under the stale step's read_len: a wrong grouping.
    c = make("placed")
    bc = c.as_batch_control()
    earlier = served(c)
    finish(c, "placed")
    assert bc.declare_step([0, 1])
    c.update_and_fetch(0, [5, 5], kv(2, 7), kv(2, 8))
    with pytest.raises(StepError, match="step=.*another step"):
        getattr(c, view)(0, earlier)


@pytest.mark.parametrize("path", ["bogus", "DENSE", "", None, 3, ["dense"]])
def test_an_unknown_attention_path_is_refused_where_it_is_assigned(path):
    # Was: accepted, and the next update_and_fetch raised only after placing and writing the step.
    c = make("declared")
    c.attention_path = "grouped"
    before = state(c)
    with pytest.raises(
        ConfigError, match=rf"attention_path={re.escape(repr(path))}: expected one of auto, dense, grouped, paged"
    ):
        c.attention_path = path
    assert c.attention_path == "grouped"
    assert_same(state(c), before)
    finish(c, "declared")


@pytest.mark.parametrize("pm", ["pm", 3, object(), CellCache], ids=["a string", "an int", "an object", "a class"])
def test_a_plugin_manager_that_is_not_one_is_refused_at_build_naming_pm(pm):
    # Was: built, then an AttributeError at the first step.
    config = CacheConfig(capacity=8, n_layers=1, layers=[LayerConfig(H, D)], kv_dtype="float32")
    with pytest.raises(ConfigError, match=r"pm=.*kvlayout_choose_cells"):
        CellCache(config, pm)


@pytest.mark.parametrize("layer", [None, "0", -1, 3, HUGE, 1.0])
def test_the_stepper_s_window_of_a_bad_layer_is_refused_by_name(layer):
    with pytest.raises(StepError, match=f"layer={re.escape(repr(layer))}"):
        make("none").groups.window(layer)


K, V = kv(2, 5), kv(2, 6)

UPDATE = [
    ("layer a string", ("0", NEXT, K, V), "layer='0'"),
    ("layer negative", (-1, NEXT, K, V), "layer=-1"),
    ("layer past n_layers", (3, NEXT, K, V), "layer=3"),
    ("layer 2**70", (HUGE, NEXT, K, V), f"layer={HUGE}"),
    ("layer NaN", (math.nan, NEXT, K, V), "layer=nan"),
    ("k int32", (0, NEXT, kv(2, dtype=mx.int32), V), r"\bk\b.*int32"),
    ("v int32", (0, NEXT, K, kv(2, dtype=mx.int32)), r"\bv\b.*int32"),
    ("k bool", (0, NEXT, kv(2, dtype=mx.bool_), V), r"\bk\b.*bool"),
    ("v complex", (0, NEXT, K, kv(2, dtype=mx.complex64)), r"\bv\b.*complex64"),
    ("k numpy", (0, NEXT, np.array(K), V), r"\bk\b"),
    ("v None", (0, NEXT, K, None), r"\bv\b"),
    ("k a list", (0, NEXT, [[1.0]], V), r"\bk\b"),
    ("k 3-d", (0, NEXT, K[0], V), r"\bk\b"),
    ("k wrong heads", (0, NEXT, kv(2, heads=H + 1), V), r"\bk\b"),
    ("v wrong head_dim", (0, NEXT, K, kv(2, dim=D + 1)), r"\bv\b"),
    ("k batch of 2", (0, NEXT, mx.concatenate([K, K]), V), r"\bk\b"),
    ("k and v token counts differ", (0, NEXT, K, kv(3)), r"\bk\b.*\bv\b"),
    ("k/v count differs from positions", (0, NEXT, kv(3), kv(3)), r"position\(s\)"),
    ("empty step", (0, [], kv(0), kv(0)), r"0 position\(s\)"),
    ("positions None", (0, None, K, V), "positions"),
    ("positions floats", (0, [4.0, 4.0], K, V), "positions"),
    ("positions NaN", (0, np.array([np.nan, 4]), K, V), "positions"),
    ("positions inf", (0, [math.inf, 4], K, V), "positions"),
    ("positions negative", (0, [-1, 4], K, V), r"positions\[0\]=-1"),
    ("positions not newer", (0, [4, 3], K, V), r"positions\[1\]=3"),
    ("positions 2**63", (0, [U64, U64], K, V), rf"positions.*(?<!-)\b{U64}\b"),
    ("positions 2**70", (0, [HUGE, 4], K, V), rf"positions.*{HUGE}"),
]


@pytest.mark.parametrize("phase", ["declared", "placed"])
@pytest.mark.parametrize("args, message", [pytest.param(*r[1:], id=r[0]) for r in UPDATE])
def test_a_bad_update_and_fetch_is_refused_by_name_before_anything_is_written(phase, args, message):
    c = make(phase)
    if phase == "placed":
        if args[0] == 0:
            args = (1, *args[1:])  # layer 0 is served already: try layer 1
        if "position" in message:  # now compared with the placed step's positions first
            message = "position"
    before = state(c)
    with pytest.raises(KVLayoutError) as info:
        c.update_and_fetch(*args)
    assert isinstance(info.value, (StepError, SequenceError)), type(info.value)
    assert re.search(message, str(info.value)), str(info.value)
    assert_same(state(c), before)
    finish(c, phase)


@pytest.mark.parametrize(
    "config", [None, "capacity=8", 8, [("capacity", 8)]], ids=["None", "a string", "an int", "a list"]
)
def test_a_cache_built_from_something_not_a_config_is_refused_by_name(config):
    with pytest.raises(KVLayoutError, match="config"):
        CellCache(config, make_plugin_manager())


# -- sizes: what a cache allocates up front, against the machine ------------------------------

SIZES = {
    "capacity 10**12": (dict(capacity=10**12), r"capacity=1000000000000 .*21\.8 TiB"),
    "max_seqs 10**15": (dict(capacity=4096, max_seqs=10**15), r"max_seqs=1000000000000000: .*477 PiB"),
    "capacity 2**63-1": (dict(capacity=2**63 - 1), rf"capacity={2**63 - 1} .*PiB"),
    "capacity and max_seqs 2**40": (dict(capacity=2**40, max_seqs=2**40), rf"capacity={2**40} and max_seqs={2**40}"),
}


@pytest.mark.parametrize("sizes, message", SIZES.values(), ids=SIZES.keys())
def test_a_cache_larger_than_any_machine_is_a_config_error_stating_its_bytes(sizes, message):
    # Not a MemoryError or OverflowError from numpy part way: refused before anything is allocated.
    config = CacheConfig(n_layers=2, layers=[LayerConfig(H, D)], kv_dtype="float32", **{"max_seqs": 64, **sizes})
    with pytest.raises(ConfigError, match=message) as info:
        CellCache(config, make_plugin_manager())
    assert "up front" in str(info.value) and "more than this machine's" in str(info.value)
    with pytest.raises(ConfigError, match="capacity="):  # the neutral table on its own, too
        CellTable(config.capacity, config.max_seqs)


def up_front(capacity, max_seqs, layers, initial):
    """The bytes the design says a cell cache allocates up front, worked by hand: per cell a
    position, owner words (one per 64 ids) and a free-list entry; per id three int64 (count, newest
    position, its cell) and a bool;
    per layer a K and a V pool of `initial` slots (float32)."""
    return capacity * (8 + 8 * -(-max_seqs // 64) + 8) + max_seqs * (8 + 8 + 8 + 1) + layers * 2 * initial * H * D * 4


# initial_capacity, and the slots each pool starts with: whole pages of 256 once past one page
@pytest.mark.parametrize(
    "capacity, max_seqs, initial, slots", [(300, 65, 16, 16), (16, 4, 4, 4), (1000, 200, 600, 768)]
)
def test_the_up_front_bytes_are_refused_exactly_past_the_machine_s_memory(
    monkeypatch, capacity, max_seqs, initial, slots
):
    import kvlayout.config

    need = up_front(capacity, max_seqs, 3, slots)
    config = CacheConfig(capacity=capacity, n_layers=3, layers=[LayerConfig(H, D)], kv_dtype="float32",
                         initial_capacity=initial, max_seqs=max_seqs)
    monkeypatch.setattr(kvlayout.config, "machine_memory", lambda: need)
    c = CellCache(config, make_plugin_manager())
    bc = c.as_batch_control()
    assert bc.capacity == capacity
    monkeypatch.setattr(kvlayout.config, "machine_memory", lambda: need - 1)
    with pytest.raises(ConfigError, match=rf"allocates .* \({need} bytes\) up front"):
        CellCache(config, make_plugin_manager())
    monkeypatch.setattr(kvlayout.config, "machine_memory", lambda: None)  # the OS cannot say: not checked
    CellCache(config, make_plugin_manager())


@pytest.mark.parametrize("layer, message", [(LayerConfig(2**40, D), "n_kv_heads"), (LayerConfig(H, 2**33), "head_dim")])
def test_a_layer_wider_than_an_mlx_dimension_is_refused_at_build_naming_the_field(layer, message):
    # Was: OverflowError from mx.zeros (with initial_capacity 0 nothing else is allocated).
    with pytest.raises(ConfigError, match=rf"layer 0: LayerConfig.{message}=\d+: expected at most 2147483647"):
        CellCache(CacheConfig(capacity=8, n_layers=1, layers=[layer], initial_capacity=0), make_plugin_manager())


def test_a_capacity_past_what_an_mlx_pool_can_index_is_refused_on_any_machine(monkeypatch):
    import kvlayout.config

    monkeypatch.setattr(kvlayout.config, "machine_memory", lambda: 2**62)  # a machine with room for the table
    top = 2**31 - 256  # the most cells whose pools, in whole pages of 256 slots, stay within int32
    with pytest.raises(ConfigError, match=rf"capacity={top + 1} .*2147483648 slots.*expected capacity <= {top}"):
        CellCache(
            CacheConfig(capacity=top + 1, n_layers=1, layers=[LayerConfig(H, D)], max_seqs=1), make_plugin_manager()
        )


# -- ids not live: the queries answer, the verbs refuse ------------------------------------------


def test_an_id_not_live_is_answered_0_by_the_queries_and_refused_by_every_verb_acting_on_it(tmp_path):
    c = make("none")
    bc = c.as_batch_control()
    bc.seq_rm(2)  # live and empty until now: the seq_rm that leaves it owning nothing releases it
    assert bc.declare_step([0, 1])  # a standing declaration: the refusals below leave it standing
    before = state(c)
    for target in (bc,):  # the verbs are the face's alone
        for dead in (2, 3):
            assert (target.seq_len(dead), target.next_pos(dead)) == (0, 0)  # as a live empty id would
            refusals = [
                (lambda: target.declare_step([0, dead]), r"seq_ids\[1\]"),
                (lambda: target.seq_clone(dead), "src"),
                (lambda: target.seq_rm(dead), "seq_id"),
                (lambda: c.save_seq(dead, tmp_path / "s.kv"), "seq_id"),
            ]
            for call, name in refusals:
                with pytest.raises(SequenceError, match=rf"{name}={dead}: expected a live sequence"):
                    call()
        for far in (-1, MAX_SEQS, HUGE):  # out of range: refused by the queries too
            for query in (target.seq_len, target.next_pos):
                with pytest.raises(SequenceError, match=f"seq_id={far}"):
                    query(far)
    assert_same(state(c), before)
    assert list(tmp_path.iterdir()) == []
    finish(c, "declared")
