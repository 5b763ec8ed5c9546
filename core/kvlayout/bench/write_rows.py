"""Row 1 (write): one-token cache writes and growth, kvlayout seq and cell vs mlx-lm's KVCache."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from kvlayout import CacheConfig, LayerConfig
from kvlayout.bench import peers
from kvlayout.bench.layouts import cell_cache, seq_cache
from kvlayout.bench.record import Row
from kvlayout.bench.sizes import H_KV, D
from kvlayout.bench.timing import interleaved, timed


def _config(capacity: int, **kw) -> CacheConfig:
    return CacheConfig(capacity=capacity, n_layers=1, layers=[LayerConfig(H_KV, D)], kv_dtype="float16", **kw)


def row_write(z: dict, ctx: dict) -> tuple[str, list[Row]]:
    KVCache = peers.mlx_lm("models.cache").KVCache
    rng = np.random.default_rng(0)
    token = mx.array(rng.normal(size=(1, H_KV, 1, D)).astype(np.float16))  # [1, H, 1, D]
    mx.eval(token)
    out: list[Row] = []
    for L in z["write_ctx"]:
        out += one_token_rows(z, L, token, rng, KVCache)
    out += growth_rows(z, token, KVCache)
    return write_work(z), out


# One token written and what it returns evaluated, on each side.
def put_seq(c, p, token):
    spec = c.update_and_fetch(0, [p], token, token)
    mx.eval(spec.keys, spec.values)


def put_cell(c, control, s, p, token):
    control.declare_step([s])
    spec = c.update_and_fetch(0, [p], token, token)
    mx.eval(spec.keys, spec.values, spec.mask)


def put_ref(c, token):
    k, v = c.update_and_fetch(token, token)
    mx.eval(k, v)


def one_token_rows(z: dict, L: int, token, rng: np.random.Generator, KVCache) -> list[Row]:
    """One token written at `L` tokens of context: seq and cell against mlx-lm's KVCache."""
    cap = L + z["write_reps"] * 4 + 64
    seq, cell, ref = seq_cache(_config(cap)), cell_cache(_config(cap)), KVCache()
    seq_control, cell_control = seq.as_control(), cell.as_batch_control()
    s0 = cell_control.seq_new()
    fill = mx.array(rng.normal(size=(1, H_KV, L, D)).astype(np.float16))
    seq.update_and_fetch(0, list(range(L)), fill, fill)
    assert cell_control.declare_step([s0] * L)
    cell.update_and_fetch(0, list(range(L)), fill, fill)
    ref.update_and_fetch(fill, fill)
    for pool in (seq.key_pools[0], seq.value_pools[0], cell.key_pools[0], cell.value_pools[0]):
        pool.evaluate()
    mx.eval(ref.keys, ref.values)

    def one_seq():
        p = seq_control.length
        return timed(lambda: put_seq(seq, p, token))

    def one_cell():
        p = cell_control.next_pos(s0)
        return timed(lambda: put_cell(cell, cell_control, s0, p, token))

    def one_ref():
        return timed(lambda: put_ref(ref, token))

    t = interleaved({"seq": one_seq, "cell": one_cell, "mlx-lm": one_ref}, z["write_reps"], warmup=2)
    return [Row.from_times("1 write", f"1 token @{L // 1024}k: seq", t, "seq", "mlx-lm"),
            Row.from_times("1 write", f"1 token @{L // 1024}k: cell", t, "cell", "mlx-lm")]


def growth_rows(z: dict, token, KVCache) -> list[Row]:
    """`grow` tokens appended one by one from empty on each side: the total, and the steps that grew the storage."""
    n = z["grow"]
    growing: dict[str, list[float]] = {"seq": [], "cell": [], "mlx-lm": []}

    def appended(side, storage, append):
        """Total time appending n tokens; also files under `side` the time the steps that grew the
        storage took beyond a typical step (their sum minus as many median non-growing steps)."""
        steps, grew = np.empty(n), np.zeros(n, dtype=bool)
        for p in range(n):
            before = storage()
            steps[p] = timed(lambda: append(p))
            grew[p] = storage() != before
        growing[side].append(float(steps[grew].sum() - grew.sum() * np.median(steps[~grew])))
        return float(steps.sum())

    def grow_seq():
        c = seq_cache(_config(n, initial_capacity=256))
        return appended("seq", lambda: c.key_pools[0].slots, lambda p: put_seq(c, p, token))

    def grow_cell():
        c = cell_cache(_config(n, initial_capacity=256))
        control = c.as_batch_control()
        s = control.seq_new()
        return appended("cell", lambda: c.key_pools[0].slots, lambda p: put_cell(c, control, s, p, token))

    def grow_ref():
        c = KVCache()
        return appended("mlx-lm", lambda: 0 if c.keys is None else c.keys.shape[2], lambda p: put_ref(c, token))

    t = interleaved({"seq": grow_seq, "cell": grow_cell, "mlx-lm": grow_ref}, z["grow_reps"], warmup=0)
    k = f"{n // 1024}k"
    g = {f"{side} growing": times for side, times in growing.items()}
    return [
        Row.from_times("1 write", f"append {k} from empty: seq", t, "seq", "mlx-lm"),
        Row.from_times("1 write", f"append {k} from empty: cell", t, "cell", "mlx-lm"),
        Row.from_times("1 write", f"growing within {k}: seq", g, "seq growing", "mlx-lm growing",
                       "seq: pools double from 256 slots; mlx-lm: a 256-slot concatenation every 256 tokens"),
        Row.from_times("1 write", f"growing within {k}: cell", g, "cell growing", "mlx-lm growing"),
    ]


def write_work(z: dict) -> str:
    """The row's description of the work."""
    n = z["grow"]
    k = f"{n // 1024}k"
    scaled = "" if n == 32768 else " (the issue's 32k under --full)"
    return (f"one layer, H_kv={H_KV}, D={D}, fp16; one-token update_and_fetch + mx.eval of what it returns at "
            f"{', '.join(f'{L // 1024}k' for L in z['write_ctx'])} context ({z['write_reps']} repeats); total time "
            f"appending {k} tokens one by one from empty{scaled}: pools start at 256 slots and double, "
            "mlx-lm grows by 256-token concatenation. cell pays its per-step bookkeeping and mask too. "
            "'growing' = the time the steps that grew the storage took beyond a median step, summed.")
