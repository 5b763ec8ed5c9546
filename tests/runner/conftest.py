"""Shared builders for the runner tests: tiny model directories and a cache-free oracle."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from kvlayout.runner import job
from kvlayout.runner.config import RunConfig
from kvlayout.spec import AttendSpec, MaskKind

# A shared "system prompt" and distinct tails, as byte-tokenizer prompts.
SYSTEM = "You are a terse assistant. Answer in one line.\n"
QUESTIONS = ["Q: what is a KV cache?\nA:", "Q: why fork?\nA:", "Q: what does a ring keep?\nA:"]


class NoCache:
    """The trivial KV face: the step's own K/V are all there is, so the caller
    must feed the whole sequence every time. Ring layers get their window as
    an explicit mask built from the positions alone."""

    def __init__(self, windows: Sequence[int]):
        self.windows = windows

    def update_and_fetch(self, layer, positions, k, v):
        w = self.windows[layer]
        if not w:
            return AttendSpec(k, v, MaskKind.CAUSAL)
        p = np.asarray(positions)
        mask = (p[None, :] <= p[:, None]) & (p[None, :] > p[:, None] - w)  # [T, T]
        return AttendSpec(k, v, MaskKind.EXPLICIT, mx.array(mask)[None, None])


def oracle_greedy(model, prompt: Sequence[int], max_tokens: int, eos: frozenset[int]) -> tuple[list[int], str]:
    """Greedy generation recomputing the whole sequence for every token."""
    tokens, out = list(prompt), []
    while True:
        logits = model(tokens, range(len(tokens)), NoCache(model.args.windows), rows=[len(tokens) - 1])
        tok = int(np.argmax(np.array(logits[0])))
        if tok in eos:
            return out, "stop"
        out.append(tok)
        if len(out) == max_tokens:
            return out, "length"
        tokens.append(tok)


def oracle_outputs(loaded, cfg: RunConfig) -> list[list[list[int]]]:
    """Every sample's greedy token ids for `cfg`'s requests (text prompts), by the cache-free forward."""
    model, _, tok, _ = loaded
    out = []
    for r in cfg.requests:
        ids, _ = oracle_greedy(model, tok.encode(r.prompt), r.max_tokens, frozenset(tok.eos_ids))
        out.append([ids] * r.n)  # greedy: every sample of a request is the same
    return out


def make_config(
    model_dir: Path, layout: str = "mlx:cell", requests: list[dict] | None = None, **sections: Any
) -> RunConfig:
    backend, kind = layout.split(":")
    data: dict[str, Any] = {
        "layout": {"backend": backend, "kind": kind},
        "cache": {"capacity": 1024, "kv_dtype": "float32"},
        "model": {"path": str(model_dir)},
        "sampling": {"temperature": 0.0},
        # The tests' prompts span several steps of 64 (preemption, stops and ranks fall among them),
        # whatever the default chunk.
        "engine": {"prefill_chunk": 64},
        "requests": requests or [{"prompt": SYSTEM + q, "max_tokens": 12, "n": 2} for q in QUESTIONS],
    }
    for name, values in sections.items():
        data[name] = {**data.get(name, {}), **values}
    return RunConfig.from_mapping(data, source="test")


def token_ids(result: job.RunResult) -> list[list[list[int]]]:
    return [[s.token_ids for s in samples] for samples in result.outputs]
