"""Shared builders for the engine tests: a tiny model, a cache of either layout, an engine over it.

The engines receive a model object; these tests build one with the runner's
preset code (the engines themselves never import it).
"""

from __future__ import annotations

import attrs
import pytest

import kvlayout
from kvlayout.config import CacheConfig
from kvlayout.engines import CellEngine, EngineOptions, Sampling, SeqEngine, Stats, make_requests
from kvlayout.models.presets import build_preset

SYSTEM = "You are a terse assistant. Answer in one line.\n"
QUESTIONS = ["Q: what is a KV cache?\nA:", "Q: why fork?\nA:", "Q: what does a ring keep?\nA:"]
ENGINES = {"seq": SeqEngine, "cell": CellEngine}


@pytest.fixture(scope="session")
def tiny():
    """(model, args, tokenizer) of the tiny preset; layer 0 slides over a window of 8 (a ring)."""
    return build_preset("tiny", sliding_window=8, layer_types=["sliding_attention", "full_attention"])


def cache_for(kind: str, args, capacity: int = 1024):
    """A float32 cache of layout mlx:<kind> shaped for the model `args` describe."""
    config = CacheConfig(
        capacity=capacity, n_layers=args.num_hidden_layers, layers=args.layer_configs(), kv_dtype="float32"
    )
    return kvlayout.build("mlx", kind, config)


@attrs.define
class Setup:
    """An engine and what it was built over; `done` counts what its progress callback was told."""

    engine: object
    cache: object
    stats: Stats
    done: list[int]


def engine_for(kind: str, tiny, cache=None, chunk: int = 16, temperature: float = 0.0, on_token=None,
               model=None) -> Setup:
    """An engine of `kind` over the tiny model (or `model` in its place); `on_token` as the engine's."""
    preset_model, args, tok = tiny
    model = preset_model if model is None else model
    cache = cache_for(kind, args) if cache is None else cache
    control = cache.as_control() if kind == "seq" else cache.as_batch_control()
    stats, done = Stats(), []
    sampling = Sampling(temperature=temperature, top_p=0.9, seed=3)
    extra = {} if on_token is None else {"on_token": on_token}
    options = EngineOptions(eos=frozenset(tok.eos_ids), sampling=sampling, chunk=chunk, stats=stats,
                            progress=done.append, **extra)
    engine = ENGINES[kind](model, cache, control, options)
    return Setup(engine, cache, stats, done)


def requests_for(tiny, questions=QUESTIONS, max_tokens: int = 8, n: int = 2, seed: int = 3):
    """Requests of SYSTEM + each question, `n` samples each, each sample with its own seeded generator."""
    _, _, tok = tiny
    prompts = [tok.encode(SYSTEM + q) for q in questions]
    return make_requests(prompts, [max_tokens] * len(prompts), [n] * len(prompts), seed)


def outputs(requests) -> list[list[tuple[list[int], str | None]]]:
    return [[(list(s.generated), s.finish_reason) for s in r.samples] for r in requests]
