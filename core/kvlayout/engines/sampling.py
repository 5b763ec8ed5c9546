"""Token sampling: greedy, temperature and top-p, one seeded generator per sample.

Each sample owns a numpy Generator seeded by (run seed, request, sample) and
draws exactly one number per sampled token, so what a sample generates never
depends on which other sequences shared its steps.
"""

from __future__ import annotations

import numpy as np


def sample_rng(seed: int, request: int, sample: int) -> np.random.Generator:
    return np.random.default_rng([seed, request, sample])


def sample_token(logits: np.ndarray, temperature: float, top_p: float, rng: np.random.Generator) -> int:
    """One token from a `[V]` float row; temperature 0 is greedy (lowest id on a tie)."""
    if temperature == 0.0:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")  # most likely first
    p_sorted = p[order]
    if top_p < 1.0:
        # Keep the smallest head whose mass reaches top_p (always at least one token).
        keep = int(np.searchsorted(np.cumsum(p_sorted), top_p) + 1)
        p_sorted = p_sorted[:keep] / p_sorted[:keep].sum()
    u = rng.random()
    i = min(int(np.searchsorted(np.cumsum(p_sorted), u, side="right")), len(p_sorted) - 1)
    return int(order[i])
