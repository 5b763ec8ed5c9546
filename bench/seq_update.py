"""Time SeqCache.update_and_fetch for one decode token at 1k, 8k and 32k (H=8, D=128, fp16).

One flat layer and one ring layer (window 4k, max_write unset so 4k) side by
side. A decode step writes one token and returns every key it attends:

- flat: the write is O(1 token) in place and the read `[0, L)` is a view of
  the pool, so the step should cost about what the read alone costs ("read"
  column: the same two views evaluated with no write);
- ring: the read is the last 4k keys, one run of the ring's mirrored slots
  (a view) even once the window wraps the ring's end: O(1), not O(window).

"keys" is how many keys the last timed step returned (S of its AttendSpec).

    python bench/seq_update.py [--repeats 100] [--json PATH]

Caches are timed round-robin (one token per cache per round, in a fresh
random order each round) so drift in the machine's load hits every row
alike; each figure is the median of its repeats, `mx.eval` of the returned
keys and values included. The returned spec is dropped before the next
write: a caller that holds it makes that write copy the whole pool
(bench/pool_write.py measures that).
"""

from __future__ import annotations

import argparse
import statistics

import mlx.core as mx
import numpy as np
from common import table, time_us, write_json

from kvlayout import CacheConfig, LayerConfig, LayerPolicy
from kvlayout_seq.mlx_cache import SeqCache

LENGTHS = (1024, 8192, 32768)
WINDOW = 4096
H, D = 8, 128
CHUNK = 4096  # prefill step; a ring takes at most its window per step
RING_TARGET = 1.5  # ring at 32k within 1.5x of ring at 8k: both hold a full window
FLAT_SLACK = 1.5  # flat's growth 1k -> 32k within 1.5x of the read's growth


def make(kind: str, capacity: int) -> SeqCache:
    policy = LayerPolicy("ring", WINDOW) if kind == "ring" else LayerPolicy()
    return SeqCache(CacheConfig(capacity=capacity, n_layers=1, layers=[LayerConfig(H, D, policy)]))


def fill(cache: SeqCache, length: int, rng: np.random.Generator) -> None:
    while cache.as_control().length < length:
        t = min(CHUNK, length - cache.as_control().length)
        k = mx.array(rng.normal(size=(1, H, t, D)).astype(np.float16))  # [1, H, t, D]
        spec = cache.update_and_fetch(0, range(cache.as_control().length, cache.as_control().length + t), k, k)
        mx.eval(spec.keys, spec.values)
        del spec


def measure(repeats: int, seed: int = 0) -> list[dict]:
    rng = np.random.default_rng(seed)
    capacity = max(LENGTHS) + repeats + 16
    caches = {}
    for kind in ("flat", "ring"):
        for n in LENGTHS:
            caches[kind, n] = make(kind, capacity)
            fill(caches[kind, n], n, rng)
    token = mx.array(rng.normal(size=(1, H, 1, D)).astype(np.float16))  # [1, H, 1, D]
    mx.eval(token)
    times = {key: [] for key in caches}
    reads = {n: [] for n in LENGTHS}
    read_len = {}

    def decode(cache):
        spec = cache.update_and_fetch(0, [cache.as_control().length], token, token)
        mx.eval(spec.keys, spec.values)
        return spec.keys.shape[2]

    def read_only(cache):
        keys = cache.key_pools[0].read(0, cache.as_control().length)  # [1, H, L, D]
        values = cache.value_pools[0].read(0, cache.as_control().length)
        mx.eval(keys, values)

    jobs = [(key, "decode") for key in caches] + [(("flat", n), "read") for n in LENGTHS]
    for i in range(-5, repeats):  # 5 warm-up rounds, not recorded
        for j in rng.permutation(len(jobs)):  # a fresh order each round: no row always follows a big copy
            key, what = jobs[j]
            cache = caches[key]
            if what == "read":
                t = time_us(lambda: read_only(cache))
                if i >= 0:
                    reads[key[1]].append(t)
                continue
            box = {}
            t = time_us(lambda: box.setdefault("s", decode(cache)))
            read_len[key] = box["s"]
            if i >= 0:
                times[key].append(t)

    med = {key: statistics.median(v) for key, v in times.items()}
    med_read = {n: statistics.median(v) for n, v in reads.items()}
    base = LENGTHS[0]
    return [
        {
            "length": n,
            "flat_us": med["flat", n],
            "flat_ratio": med["flat", n] / med["flat", base],
            "flat_keys": read_len["flat", n],
            "read_us": med_read[n],
            "read_ratio": med_read[n] / med_read[base],
            "ring_us": med["ring", n],
            "ring_ratio": med["ring", n] / med["ring", base],
            "ring_keys": read_len["ring", n],
        }
        for n in LENGTHS
    ]


COLUMNS = [
    ("length", "length", ""),
    ("flat us", "flat_us", ".1f"),
    ("x1k", "flat_ratio", ".2f"),
    ("keys", "flat_keys", ""),
    ("read only us", "read_us", ".1f"),
    ("x1k", "read_ratio", ".2f"),
    ("ring w4k us", "ring_us", ".1f"),
    ("x1k", "ring_ratio", ".2f"),
    ("keys", "ring_keys", ""),
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=100, help="timed tokens per cache (default 100)")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = parser.parse_args(argv)

    rows = measure(args.repeats)
    by_len = {r["length"]: r for r in rows}
    first, mid, last = (by_len[n] for n in LENGTHS)
    ring_growth = last["ring_us"] / mid["ring_us"]
    ring_met = ring_growth <= RING_TARGET
    flat_met = last["flat_ratio"] <= FLAT_SLACK * max(last["read_ratio"], 1.0)
    print(f"SeqCache.update_and_fetch, one decode token, H={H} D={D} float16, "
          f"device {mx.default_device()}, median of {args.repeats}")
    print(table(COLUMNS, rows))
    print(f"ring at {LENGTHS[-1]} is {ring_growth:.2f}x ring at {LENGTHS[1]} (both a full {WINDOW} window; "
          f"target <= {RING_TARGET}x): {'met' if ring_met else 'NOT met'}")
    print(f"flat grew {last['flat_ratio']:.2f}x from {LENGTHS[0]} to {LENGTHS[-1]}, the read alone "
          f"{last['read_ratio']:.2f}x (target: within {FLAT_SLACK}x of the read's growth): "
          f"{'met' if flat_met else 'NOT met'}")
    write_json(
        args.json, "seq_update", heads=H, head_dim=D, dtype="float16", window=WINDOW,
        repeats=args.repeats, ring_growth_8k_to_32k=ring_growth, ring_target_met=ring_met,
        flat_target_met=flat_met, rows=rows,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
