"""Per-step bookkeeping of the cell layout beside one layer's attention.

For 64 sequences decoding one token each over a table whose used_end is 4k,
32k and 128k cells, time what the cell layout adds to a forward step
(declare_step + place_step, which builds the mask for one window) and, in the
same run over the same read window, one `mx.fast.scaled_dot_product_attention`
call (H_q=32, H_kv=8, D=128, fp16, 64 queries, the step's mask, mx.eval'd).
Medians of several repeats; the ratio is bookkeeping / attention (target:
under 0.25, i.e. under 1% of a 32-layer forward).

The table is filled by one step through the protocol (64 interleaved sequences,
lowest-free placement) rather than by prefill steps per sequence, whose masks
would cost O(used_end^2) to set up. After each
measured step the 64 new cells are removed again (not timed) and the free list
rebuilt, so every repeat sees the same used_end and the warm free list of a
steady decode.

    python bench/cell_bookkeeping.py [--sizes 4096,32768,131072] [--repeats 20]
        [--attn-repeats 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import common
import mlx.core as mx
import numpy as np

from kvlayout.registry import make_plugin_manager
from kvlayout_cell.plugin import LowestFree
from kvlayout_cell.stepper import Stepper
from kvlayout_cell.table import CellTable

N_SEQS, H_Q, H_KV, D = 64, 32, 8, 128


COLUMNS = [
    ("used_end", "used_end", ""),
    ("read_len", "read_len", ""),
    ("book ms", "bookkeeping_ms", ".3f"),
    ("mask->mx ms", "mask_to_mlx_ms", ".3f"),
    ("attn ms", "attention_ms", ".1f"),
    ("book/attn", "ratio", ".4f"),
    ("(+mx)/attn", "ratio_with_mask_to_mlx", ".4f"),
]


def filled_stepper(used_end: int) -> Stepper:
    pm = make_plugin_manager()
    pm.register(LowestFree())  # the interleaved table below is lowest-free's layout
    stepper = Stepper(CellTable(used_end + 2 * N_SEQS, N_SEQS), [0], pm)
    for _ in range(N_SEQS):
        stepper.seq_new()
    cells = np.arange(used_end, dtype=np.int64)
    # One step through the protocol: lowest-free placement puts token i in cell i, so seq s holds s, s+64, ...
    assert stepper.declare_step(cells % N_SEQS)
    assert stepper.place_step(0, cells // N_SEQS).cells.tolist() == cells.tolist()
    return stepper


def time_bookkeeping(stepper: Stepper, repeats: int):
    ids = list(range(N_SEQS))
    times, step = [], None
    for _ in range(repeats):
        positions = [stepper.table.next_pos(s) for s in ids]
        stepper.table.free_list()  # warm, as in a steady decode
        t0 = time.perf_counter()
        assert stepper.declare_step(ids)
        step = stepper.place_step(0, positions)
        times.append(time.perf_counter() - t0)
        for s, p in zip(ids, positions):  # undo, untimed: same used_end next repeat
            stepper.seq_rm(s, p)
    return statistics.median(times), step


def time_mask_to_mlx(mask: np.ndarray, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        m = mx.array(mask)[None, None]
        mx.eval(m)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def time_attention(read_len: int, mask: np.ndarray, repeats: int) -> float:
    q = mx.random.normal((1, H_Q, N_SEQS, D)).astype(mx.float16)  # [1, Hq, T, D]
    k = mx.random.normal((1, H_KV, read_len, D)).astype(mx.float16)  # [1, Hkv, S, D]
    v = mx.random.normal((1, H_KV, read_len, D)).astype(mx.float16)
    m = mx.array(mask)[None, None]  # [1, 1, T, S]
    mx.eval(q, k, v, m)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        mx.eval(mx.fast.scaled_dot_product_attention(q, k, v, scale=D**-0.5, mask=m))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="4096,32768,131072", help="used_end values, comma-separated")
    ap.add_argument("--repeats", type=int, default=20, help="bookkeeping repeats per size")
    ap.add_argument("--attn-repeats", type=int, default=3, help="attention repeats per size")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = ap.parse_args()

    time_attention(256, np.ones((N_SEQS, 256), dtype=bool), 1)  # warm-up, not reported
    rows = []
    for used_end in (int(s) for s in args.sizes.split(",")):
        stepper = filled_stepper(used_end)
        book, step = time_bookkeeping(stepper, args.repeats)
        to_mlx = time_mask_to_mlx(step.mask, args.repeats)
        attn = time_attention(step.read_len, step.mask, args.attn_repeats)
        rows.append(
            dict(
                used_end=used_end,
                read_len=step.read_len,
                bookkeeping_ms=book * 1e3,
                mask_to_mlx_ms=to_mlx * 1e3,
                attention_ms=attn * 1e3,
                ratio=book / attn,
                ratio_with_mask_to_mlx=(book + to_mlx) / attn,
            )
        )

    device = mx.default_device()
    print(f"cell bookkeeping vs one attention layer  ({N_SEQS} seqs x 1 token, H_q={H_Q}, "
          f"H_kv={H_KV}, D={D}, fp16, {device}, {platform.machine()})")
    print(f"medians: bookkeeping of {args.repeats} repeats, attention of {args.attn_repeats}")
    print(common.table(COLUMNS, rows))
    print("target: book/attn < 0.25")
    common.write_json(args.json, "cell_bookkeeping", n_seqs=N_SEQS, h_q=H_Q, h_kv=H_KV, head_dim=D, dtype="float16",
               repeats=args.repeats, attn_repeats=args.attn_repeats, rows=rows)

if __name__ == "__main__":
    main()
