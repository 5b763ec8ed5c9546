"""Time a one-token write into MLXPool of 1k, 8k and 64k slots (H=8, D=128, fp16).

A write must cost O(bytes written), not O(pool): MLX updates the buffer in
place only while the pool holds its single reference. The last column keeps a
`read()` alive across each write, which forces that write to copy the whole
pool: that is the cost a caller pays for holding on to a read.

    python bench/pool_write.py [--repeats 200] [--json PATH]

Sizes are timed round-robin (one write per pool per round) so drift in the
machine's load hits every size alike; each figure is the median of its repeats,
`mx.eval` after every write included.
"""

from __future__ import annotations

import argparse
import statistics

import mlx.core as mx
import numpy as np
from common import table, time_us, write_json

from kvlayout.mlx import MLXPool

SIZES = (1024, 8192, 65536)
H, D = 8, 128
TARGET = 1.5  # write at 64k within 1.5x of the write at 1k


def sync(pool: MLXPool) -> None:
    """Finish the pool's pending write; unlike evaluating a read() this creates no array."""
    pool.evaluate()


def measure(repeats: int, held_repeats: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    pools = {n: MLXPool(n, n, H, D, "float16") for n in SIZES}
    for pool in pools.values():
        sync(pool)
    token = mx.array(rng.normal(size=(1, H, 1, D)).astype(np.float16))  # [1, H, 1, D]
    mx.eval(token)
    times: dict[str, dict[int, list[float]]] = {k: {n: [] for n in SIZES} for k in ("write", "cells", "held")}

    def write(pool, slot):
        pool.write(slot, token)
        sync(pool)

    def write_cells(pool, slot):
        pool.write_cells([slot], token)
        sync(pool)

    for i in range(-10, repeats):  # 10 warm-up rounds, not recorded
        for n, pool in pools.items():
            slot = int(rng.integers(n))
            t_write = time_us(lambda: write(pool, slot))
            t_cells = time_us(lambda: write_cells(pool, (slot * 7 + 1) % n))
            if i >= 0:
                times["write"][n].append(t_write)
                times["cells"][n].append(t_cells)
    for i in range(-2, held_repeats):
        for n, pool in pools.items():
            held = pool.read(0, 1)  # a caller's read, alive across the next write
            mx.eval(held)
            t_held = time_us(lambda: write(pool, int(rng.integers(n))))
            del held
            if i >= 0:
                times["held"][n].append(t_held)

    med = {k: {n: statistics.median(v) for n, v in by_size.items()} for k, by_size in times.items()}
    base = SIZES[0]
    return [
        {
            "slots": n,
            "pool_mib": n * H * D * 2 / 2**20,
            "write_us": med["write"][n],
            "write_ratio": med["write"][n] / med["write"][base],
            "write_cells_us": med["cells"][n],
            "write_cells_ratio": med["cells"][n] / med["cells"][base],
            "write_read_held_us": med["held"][n],
            "write_read_held_ratio": med["held"][n] / med["write"][base],
        }
        for n in SIZES
    ]


COLUMNS = [
    ("slots", "slots", ""),
    ("pool MiB", "pool_mib", ".0f"),
    ("write us", "write_us", ".1f"),
    ("x1k", "write_ratio", ".2f"),
    ("write_cells us", "write_cells_us", ".1f"),
    ("x1k", "write_cells_ratio", ".2f"),
    ("write, read held us", "write_read_held_us", ".1f"),
    ("x1k write", "write_read_held_ratio", ".1f"),
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=200, help="timed writes per size (default 200)")
    parser.add_argument("--held-repeats", type=int, default=20, help="timed writes with a read held (default 20)")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = parser.parse_args(argv)

    rows = measure(args.repeats, args.held_repeats)
    big = rows[-1]
    print(f"MLXPool one-token writes, H={H} D={D} float16, device {mx.default_device()}, "
          f"median of {args.repeats} ({args.held_repeats} with a read held)")
    print(table(COLUMNS, rows))
    met = big["write_ratio"] <= TARGET
    print(f"write at {big['slots']} slots is {big['write_ratio']:.2f}x the write at {SIZES[0]} "
          f"(target <= {TARGET}x): {'met' if met else 'NOT met'}")
    write_json(
        args.json, "pool_write", heads=H, head_dim=D, dtype="float16", repeats=args.repeats,
        held_repeats=args.held_repeats, target_ratio=TARGET, target_met=met, rows=rows,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
