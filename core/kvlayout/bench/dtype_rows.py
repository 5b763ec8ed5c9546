"""Row 7 (fp16): float16 vs float32 attention on this device (why kv_dtype "auto" picks float32 on the CPU)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from kvlayout.bench.record import Row
from kvlayout.bench.timing import interleaved, timed


def row_fp16(z: dict, ctx: dict) -> tuple[str, list[Row]]:
    h_q, h_kv, d = z["attn_heads"]
    rng = np.random.default_rng(7)
    out = []
    cases = {"prefill 256 x 4k causal": (256, 4096, "causal"), "decode 32 x 1k": (32, 1024, None)}
    for name, (T, S, mask) in cases.items():
        if mask is None:  # 32 sequences alone: batched, one query each
            shapes = ((T, h_q, 1, d), (T, h_kv, S, d))
        else:
            shapes = ((1, h_q, T, d), (1, h_kv, S, d))
        q32 = mx.array(rng.normal(size=shapes[0]).astype(np.float32))
        k32 = mx.array(rng.normal(size=shapes[1]).astype(np.float32))
        v32 = mx.array(rng.normal(size=shapes[1]).astype(np.float32))
        q16, k16, v16 = (x.astype(mx.float16) for x in (q32, k32, v32))
        mx.eval(q32, k32, v32, q16, k16, v16)

        def side(q, k, v):
            return lambda: timed(lambda: mx.eval(mx.fast.scaled_dot_product_attention(q, k, v, scale=d**-0.5,
                                                                                        mask=mask)))

        t = interleaved({"fp16": side(q16, k16, v16), "fp32": side(q32, k32, v32)}, z["repeats"])
        out.append(Row.from_times("7 fp16", name, t, "fp16", "fp32"))
    work = (f"mx.fast.scaled_dot_product_attention, H_q={h_q}, H_kv={h_kv}, D={d}, q/K/V all in the one dtype, on "
            f"{mx.default_device()}; the runner's kv_dtype 'auto' picks float32 on the CPU because of this.")
    return work, out

