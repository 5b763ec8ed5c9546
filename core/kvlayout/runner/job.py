"""A run of `kvlayout run`: the config checked, the model loaded, the cache built, an engine driven.

The runner knows layouts only by their faces. A cache with a BatchControl
face (`as_batch_control()`) gets continuous batching (engines.cell); one with
only a SequenceControl face (`as_control()`) runs one sequence at a time
(engines.seq). Both fill the same records, so greedy outputs can be compared
token for token.

`prepare` raises every user error (layout not installed, model directory,
capacity) before anything runs; `Job.generate` then generates.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import attrs
import mlx.core as mx

from kvlayout import registry
from kvlayout.config import CacheConfig
from kvlayout.engines.cell import CellEngine
from kvlayout.engines.interface import Engine
from kvlayout.engines.records import OnProgress, Sampling, Stats, make_requests
from kvlayout.engines.recovery import Interrupted
from kvlayout.engines.seq import SeqEngine
from kvlayout.errors import ConfigError, KVLayoutError
from kvlayout.faces import BatchControl, SequenceControl, contract
from kvlayout.mlx.pool import DTYPES
from kvlayout.runner.config import RunConfig
from kvlayout.runner.records import RunResult, SampleResult

__all__ = ["Job", "RunResult", "load_model_for", "prepare", "run"]


def check_capacity(cfg: RunConfig, prompts: Sequence[Sequence[int]]) -> None:
    """Every request must fit alone: its prompt plus n × max_tokens cells."""
    capacity = cfg.cache.capacity
    for i, (r, prompt) in enumerate(zip(cfg.requests, prompts)):
        need = len(prompt) + r.n * r.max_tokens
        if need > capacity:
            raise ConfigError(
                f"requests[{i}] needs {len(prompt)} prompt + {r.n} x {r.max_tokens} max_tokens = "
                f"{need} cells, more than cache.capacity={capacity}; raise cache.capacity to at least "
                f"{need} or shorten the request"
            )


def default_kv_dtype(model_dtype: mx.Dtype) -> str:
    """float32 on the CPU device (MLX's CPU half-precision attention is much slower); else half."""
    if mx.default_device() == mx.cpu:
        return "float32"
    return "bfloat16" if model_dtype == mx.bfloat16 else "float16"


def cache_config(cfg: RunConfig, args, kv_dtype: str) -> CacheConfig:
    layers = args.layer_configs()
    if len(set(layers)) == 1:
        layers = layers[:1]
    return CacheConfig(
        capacity=cfg.cache.capacity,
        n_layers=args.num_hidden_layers,
        layers=layers,
        kv_dtype=kv_dtype,
        initial_capacity=min(cfg.cache.initial_capacity, cfg.cache.capacity),
        max_write=cfg.cache.max_write,
        max_seqs=cfg.cache.max_seqs,
    )


def load_model_for(cfg: RunConfig):
    """Load the model the config's [model] section names: (model, args, tokenizer, name).

    (A saved cache is loaded by `kvlayout.load`; this loads only a model.)
    """
    from kvlayout.models.loading import load_model
    from kvlayout.models.presets import build_preset

    dtype = None if cfg.model.dtype == "auto" else cfg.model.dtype
    if cfg.model.preset is not None:
        model, args, tok = build_preset(cfg.model.preset, seed=cfg.model.seed)
        if dtype is not None:
            model.set_dtype(DTYPES[dtype])
        return model, args, tok, f"preset:{cfg.model.preset}"
    model_dir = cfg.model_dir()
    model, args, tok = load_model(model_dir, dtype)
    return model, args, tok, str(model_dir)


@attrs.define
class Job:
    """A validated run, ready to generate: every user error was raised by `prepare`."""

    cfg: RunConfig
    builder: Any
    model: Any
    args: Any
    tokenizer: Any
    model_name: str
    prompts: list[list[int]]
    kv_dtype: str
    cache: Any
    resumed: Any = None  # a resume.RunState when prepared with resume=DIR

    @property
    def planned_tokens(self) -> int:
        return sum(r.n * r.max_tokens for r in self.cfg.requests)

    def make_engine(self, stats: Stats, progress: OnProgress) -> Engine:
        """A fresh engine over the cache, chosen by its faces, with no work queued.

        A BatchControl face gets continuous batching (CellEngine), a lone
        SequenceControl face one sequence at a time (SeqEngine).
        """
        cfg, cache = self.cfg, self.cache
        sampling = Sampling(cfg.sampling.temperature, cfg.sampling.top_p, cfg.sampling.seed)
        eos = frozenset(self.tokenizer.eos_ids)
        bc = cache.as_batch_control()
        if bc is not None:
            return CellEngine(self.model, cache, bc, eos, sampling, cfg.engine.prefill_chunk, stats, progress)
        return SeqEngine(self.model, cache, cache.as_control(), eos, sampling, cfg.engine.prefill_chunk, stats, progress)

    def generate(self, progress: OnProgress | None = None, stop=None, save_state=None) -> RunResult:
        """Generate every request (the unfinished ones, when resumed).

        `stop()`, asked before every step, ends the run early between two
        steps (`RunResult.complete` False). `save_state` (a directory) gets
        the cache and the run's state when the run ends, early or not, and
        when a Ctrl-C interrupts a forward (the step is aborted first, then
        `engines.Interrupted` propagates); `prepare(cfg, resume=DIR)`
        continues from it.
        """
        from kvlayout.runner import resume

        cfg, tok, cache = self.cfg, self.tokenizer, self.cache
        requests = make_requests(
            self.prompts, [r.max_tokens for r in cfg.requests], [r.n for r in cfg.requests], cfg.sampling.seed
        )
        stats = Stats(layout=self.builder.key, kv_dtype=self.kv_dtype, model=self.model_name)
        progress = progress or (lambda n: None)
        if self.resumed is not None:
            stats = self.resumed.apply_samples(requests, Stats)
            progress(self.resumed.done_tokens(requests))
        t0 = time.perf_counter()
        engine = self.make_engine(stats, progress)
        try:
            if self.resumed is not None:
                self.resumed.restore_engine(engine, requests)
            else:
                engine.add(requests)
            complete = engine.run(stop)
        except Interrupted:
            if save_state is not None:
                stats.wall_s += time.perf_counter() - t0
                resume.save_run(save_state, self, requests, engine, stats, complete=False)
            raise
        stats.wall_s += time.perf_counter() - t0
        if save_state is not None:
            resume.save_run(save_state, self, requests, engine, stats, complete)
        outputs = [
            [SampleResult(list(s.generated), tok.decode(s.generated), s.finish_reason or "pending", s.error) for s in r.samples]
            for r in requests
        ]
        texts = [r.prompt if r.prompt is not None else tok.decode(p) for r, p in zip(cfg.requests, self.prompts)]
        return RunResult(requests, outputs, stats, texts, complete)


def prepare(cfg: RunConfig, loaded=None, resume=None) -> Job:
    """Resolve the layout, load the model, check every request fits, build the cache.

    `loaded` reuses a (model, args, tokenizer, name) from `load_model_for`. Every user
    error (layout not installed, model directory, capacity) is raised here,
    before anything is generated. `resume` (a directory `generate(save_state=)`
    wrote) loads the cache and the run's state from it instead of starting
    afresh; StateError when it was saved by a run with another config.
    """
    builder = registry.resolve(cfg.layout.backend, cfg.layout.kind)  # LayoutNotFound before loading
    model, args, tok, name = loaded if loaded is not None else load_model_for(cfg)
    prompts = [list(r.prompt_ids) if r.prompt_ids is not None else tok.encode(r.prompt) for r in cfg.requests]
    for i, p in enumerate(prompts):
        if not p:
            raise ConfigError(f"requests[{i}].prompt encodes to no tokens; give a longer prompt")
        bad = [t for t in p if t >= args.vocab_size]
        if bad:
            raise ConfigError(f"requests[{i}].prompt_ids: id {bad[0]} is outside the vocabulary (size {args.vocab_size})")
    check_capacity(cfg, prompts)
    kv_dtype = default_kv_dtype(model.dtype) if cfg.cache.kv_dtype == "auto" else cfg.cache.kv_dtype
    if resume is not None:
        from kvlayout.runner import resume as resuming

        fp = resuming.fingerprint(cfg, prompts, kv_dtype)
        resumed, cache = resuming.load_run(resume, fp, cache_config(cfg, args, kv_dtype))
    else:
        resumed, cache = None, builder.build(cache_config(cfg, args, kv_dtype))
    check_faces(builder.key, cache)
    return Job(cfg, builder, model, args, tok, name, prompts, kv_dtype, cache, resumed)


def check_faces(key: str, cache: Any) -> None:
    """The face the runner will drive exists and has every member of its contract; else one line.

    A third-party layout written against an older contract (a SequenceControl
    without `max_step`, say) is refused here, naming what it lacks, not by an
    AttributeError in the middle of a run.
    """
    for protocol, face in ((BatchControl, cache.as_batch_control()), (SequenceControl, cache.as_control())):
        if face is not None:
            missing = [m for m in contract(protocol) if not hasattr(face, m)]
            if missing:
                raise KVLayoutError(f"layout {key}: its {protocol.__name__} face lacks {', '.join(missing)}")
            return
    raise KVLayoutError(f"layout {key} offers neither a batch nor a sequence control face; the runner cannot drive it")


def run(cfg: RunConfig, progress: OnProgress | None = None, loaded=None) -> RunResult:
    """Generate every request of `cfg`; `loaded` reuses a (model, args, tokenizer, name)."""
    return prepare(cfg, loaded).generate(progress)
