"""A run of `kvlayout run`: the config checked, the model loaded, the cache built, an engine driven.

The runner knows layouts only by their faces. A cache with a BatchControl
face (`as_batch_control()`) gets continuous batching (engines.cell); one with
only a SequenceControl face (`as_control()`) runs one sequence at a time
(engines.seq). Both fill the same records, so greedy outputs can be compared
token for token.

`prepare` raises every user error (layout not installed, model directory,
a chat without a template, capacity) before anything runs; `Job.generate`
then generates, telling `on_text` each sample's new text as it comes.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Any

import attrs
import mlx.core as mx
import numpy as np

from kvlayout import registry
from kvlayout.config import CacheConfig
from kvlayout.distributed import RankedModel, World
from kvlayout.engines.cell import CellEngine
from kvlayout.engines.interface import Engine
from kvlayout.engines.options import EngineOptions
from kvlayout.engines.records import OnProgress, OnToken, Sampling, Stats, ignore_tokens, make_requests, same_tokens
from kvlayout.engines.seq import SeqEngine
from kvlayout.errors import ConfigError, Interrupted, KVLayoutError, RunInterrupted, SaveFailed, one_line
from kvlayout.faces import BatchControl, SequenceControl, contract
from kvlayout.models.shard import check_shardable, local_args, model_bytes, shard_model, shards_of
from kvlayout.runner import blas
from kvlayout.runner.config import ModelSection, RunConfig
from kvlayout.runner.prompts import Prompt, build_prompts
from kvlayout.runner.records import KVBytes, OnText, RunResult, SampleResult, TextEvent
from kvlayout.runner.text import SampleText

__all__ = ["Job", "RunResult", "dequantize_as_configured", "load_model_for", "prepare", "run"]


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
    """The config's [cache] for the model `args` describes (one LayerConfig when all are alike)."""
    layers = args.layer_configs()
    if len(set(layers)) == 1:
        layers = layers[:1]
    return cfg.cache.cache_config(args.num_hidden_layers, layers, kv_dtype)


def load_model_for(cfg: RunConfig):
    """Load the model the config's [model] section names: (model, args, tokenizer, name).

    (A saved cache is loaded by `kvlayout.load`; this loads only a model.)
    """
    from kvlayout.models.loading import load_model
    from kvlayout.models.presets import build_preset, preset_title

    dtype = None if cfg.model.dtype == "auto" else cfg.model.dtype
    if cfg.model.preset is not None:
        model, args, tok = build_preset(cfg.model.preset, seed=cfg.model.seed, dtype=dtype)
        return model, args, tok, preset_title(cfg.model.preset)
    model_dir = cfg.model_dir()
    model, args, tok = load_model(model_dir, dtype)
    return model, args, tok, str(model_dir)


def load_with_fallback(cfg: RunConfig):
    """(config, loaded, notices): the config's model, or, when it cannot be had and the config
    names a `model.fallback`, that preset, the config saying so and the notice saying why; a
    quantized one dequantized as [model] says (`dequantize_as_configured`)."""
    try:
        loaded, notices = load_model_for(cfg), []
    except ConfigError as exc:
        if cfg.model.fallback is None:
            raise
        reason = one_line(exc)  # whatever the reason held
        m = cfg.model
        cfg = attrs.evolve(cfg, model=attrs.evolve(m, path=None, preset=m.fallback, fallback=None), plain_chat=True)
        notice = f"model preset {m.preset!r} cannot be had: {reason}; running the {m.fallback!r} preset instead"
        loaded, notices = load_model_for(cfg), [notice]
    loaded, said = dequantize_as_configured(cfg.model, loaded)
    return cfg, loaded, notices + said


def dequantize_as_configured(section: ModelSection, loaded):
    """(loaded, notices): a quantized model unpacked into float layers where [model] dequantize says
    so (`ModelSection`), its name then saying so (the run's heading, report and JSON `model`; a
    resumed run must agree); a float model, or one left packed, as it came.

    Why "auto" does it on the CPU when a fast BLAS is in use (`blas.fast`): MLX's CPU backend
    multiplies packed weights at a cost linear in the step's tokens, float32 ones through BLAS;
    with the reference BLAS MLX's Linux wheel bundles, float32 decodes slower than packed (4.8 vs
    8.7 tok/s on SmolLM2), so "auto" leaves them packed there. A model "auto" leaves packed for its
    size alone is named in a notice, with the key that lets it through.
    """
    from kvlayout.mlx.pool import DTYPES
    from kvlayout.models.loading import check_experts_dtype
    from kvlayout.models.quantization import dequantize_model, dequantized_nbytes, packed_bits

    model, args, tok, name = loaded
    bits = packed_bits(model)
    if not bits or section.dequantize is False:
        return loaded, []
    dtype = mx.float32 if section.dtype == "auto" else DTYPES[section.dtype]
    if section.dequantize == "auto":
        if mx.default_device() != mx.cpu or dtype != mx.float32 or not blas.fast():
            return loaded, []  # a GPU's quantized kernels are fast; a half dtype was asked for; no fast BLAS
        need_mb = -(-dequantized_nbytes(model, dtype) // 2**20)  # rounded up
        if need_mb > section.dequantize_max_mb:
            return loaded, [
                f"{name} stays {bits} quantized: its float32 weights would take {need_mb} MB, over "
                f"model.dequantize_max_mb={section.dequantize_max_mb}; raise it to run its matmuls at BLAS speed "
                "on the CPU (MLX multiplies packed weights far slower there)"
            ]
    dequantize_model(model, dtype)
    check_experts_dtype(model, name)  # unpacked experts in a half dtype cannot run on the CPU
    return (model, args, tok, f"{name} ({bits} dequantized to {str(dtype).removeprefix('mlx.core.')})"), []


@attrs.define
class Job:
    """A validated run, ready to generate: every user error was raised by `prepare`.

    `notices` are what the run must tell its user before it starts (a
    fallback model, chat sent as plain text), one line each.
    """

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
    built: list[Prompt] = attrs.field(factory=list)  # each request's prompt: ids, text, messages
    notices: list[str] = attrs.field(factory=list)
    # The ranks of a tensor-parallel run (each process runs a Job over its shard); a world of one else.
    world: World = attrs.field(factory=World)
    _fingerprint: dict | None = attrs.field(default=None, init=False, repr=False)

    def fingerprint(self) -> dict:
        """What a resumed run must share with this one (`resume.fingerprint`), the model's files
        hashed once, the first time it is asked (before the run, when it saves or resumes)."""
        if self._fingerprint is None:
            from kvlayout.runner import resume

            source = model_source(self.cfg)
            files = None if source is None else resume.model_files(source)
            self._fingerprint = resume.fingerprint(self.cfg, self.prompts, self.kv_dtype, files)
        return self._fingerprint

    @property
    def planned_tokens(self) -> int:
        return sum(r.n * r.max_tokens for r in self.cfg.requests)

    def make_engine(self, stats: Stats, progress: OnProgress, on_token: OnToken = ignore_tokens,
                    prefixes: Any = None, max_samples: int | None = None) -> Engine:
        """A fresh engine over the cache, chosen by its faces, with no work queued.

        A BatchControl face gets continuous batching (CellEngine), a lone
        SequenceControl face one sequence at a time (SeqEngine). `prefixes`
        (an engines.prefixes.PrefixCache over this cache, e.g. a server's)
        keeps finished sequences' cells for reuse; only CellEngine takes one. `max_samples` caps
        the samples generating at once (a server's max_sequences; EngineOptions).
        """
        cfg, cache = self.cfg, self.cache
        options = EngineOptions(
            eos=frozenset(self.tokenizer.eos_ids),
            sampling=Sampling(cfg.sampling.temperature, cfg.sampling.top_p, cfg.sampling.seed),
            chunk=cfg.engine.prefill_chunk,
            stats=stats,
            progress=progress,
            on_token=on_token,
            # One process draws its own tokens: the engines may draw them on the device (engines.ahead).
            agree=self.agree_tokens if self.world.distributed else same_tokens,
            pipeline=cfg.engine.pipeline,
            max_samples=max_samples,
            speculate=cfg.engine.speculate,
            speculate_tokens=cfg.engine.speculate_tokens,
        )
        bc = cache.as_batch_control()
        if bc is not None:
            return CellEngine(self.model, cache, bc, options, prefixes)
        return SeqEngine(self.model, cache, cache.as_control(), options)  # it keeps its steps within max_step

    def model_bytes(self) -> int:
        """Bytes of the model's parameters this process holds (its shard, when tensor-parallel)."""
        return model_bytes(self.model)

    def agree_tokens(self, tokens: list[int]) -> list[int]:
        """The engines' Agree: the step's tokens as rank 0 drew them (the tokens as they are in one process)."""
        return self.world.agree_tokens(tokens, self.table_digest)

    def table_digest(self) -> bytes:
        """Bytes that change with anything the cache's bookkeeping holds (who owns which cell at which
        position; a sequence's length): what every rank compares each step with KVLAYOUT_CHECK_RANKS=1."""
        view = self.cache.as_cell_view()
        if view is not None:
            return b"".join(np.ascontiguousarray(a).tobytes() for a in view.cell_owners())
        return str(self.cache.as_control().length).encode()

    def new_requests(self) -> list:
        """The run's requests, fresh: no sample started."""
        cfg = self.cfg
        return make_requests(
            self.prompts, [r.max_tokens for r in cfg.requests], [r.n for r in cfg.requests], cfg.sampling.seed
        )

    def check_resume(self) -> None:
        """Take the saved state up on a throwaway engine over fresh requests (nothing runs, the
        cache is only read), then check run.json's seal: StateError naming what disagrees."""
        requests = self.new_requests()
        self.resumed.apply_samples(requests, Stats)
        self.resumed.restore_engine(self.make_engine(Stats(), lambda n: None), requests)
        self.resumed.check_seal()

    def generate(
        self, progress: OnProgress | None = None, stop=None, save_state=None, on_text: OnText | None = None
    ) -> RunResult:
        """Generate every request (the unfinished ones, when resumed).

        `on_text` hears each sample's new text as it is generated
        (`records.TextEvent`: whole characters, nothing of a stop string).

        `stop()`, asked before every step, ends the run early between two
        steps (`RunResult.complete` False). `save_state` (a directory) gets
        the cache and the run's state when the run ends, early or not, and
        when a Ctrl-C interrupts a forward (the step is aborted first, then
        `RunInterrupted`, an `engines.Interrupted`, propagates);
        `prepare(cfg, resume=DIR)` continues from it. A save that fails
        loses nothing of the run: the result (or the RunInterrupted) carries
        `save_failed`, which says why and what the directory holds now.
        """
        requests = self.new_requests()
        progress = progress or (lambda n: None)
        stats = self._starting_stats(requests, progress)
        texts = self._sample_texts(requests, every=on_text is not None)

        def heard(request, sample, token) -> None:
            new = texts[request.index, sample.index].take_new(final=sample.finish_reason is not None)
            on_text(TextEvent(request.index, sample.index, token, new, sample.finish_reason))

        t0 = time.perf_counter()
        engine = self.make_engine(stats, progress, heard if on_text is not None else ignore_tokens)
        try:
            if self.resumed is not None:
                self.resumed.restore_engine(engine, requests)
            else:
                engine.add(requests)
            complete = engine.run(self.world.leaders_stop(stop))  # tensor-parallel: rank 0's Ctrl-C stops all
        except Interrupted as exc:
            failed = None
            if save_state is not None:
                stats.wall_s += time.perf_counter() - t0
                failed = self._save(save_state, requests, engine, stats, False)
            raise RunInterrupted(failed) from exc
        stats.wall_s += time.perf_counter() - t0
        failed = self._save(save_state, requests, engine, stats, complete) if save_state is not None else None
        return self._result(requests, texts, stats, complete, failed)

    def _starting_stats(self, requests: list, progress: OnProgress) -> Stats:
        """The run's Stats: fresh, or when resumed the saved run's, its samples taken up again and the
        tokens they already hold reported as progress."""
        if self.resumed is None:
            return Stats(layout=self.builder.key, kv_dtype=self.kv_dtype, model=self.model_name)
        stats = self.resumed.apply_samples(requests, Stats)
        progress(self.resumed.done_tokens(requests))
        return stats

    def _sample_texts(self, requests: list, every: bool) -> dict[tuple[int, int], SampleText]:
        """The text and stop strings of each sample that needs them as it is generated, by (request,
        sample) index: every sample when `every` (its text is heard live), else those with stop strings.
        Each is also its sample's stopper: the engine asks it about every token the sample keeps. A
        sample with neither is decoded once, at the end (`_result`): no per-token work for it."""
        texts = {}
        for r, spec in zip(requests, self.cfg.requests):
            for s in r.samples:
                if every or spec.stop:
                    s.stopper = texts[r.index, s.index] = SampleText(self.tokenizer.decode, spec.stop, s.generated)
        return texts

    def _result(self, requests: list, texts: dict[tuple[int, int], SampleText], stats: Stats, complete: bool,
                failed) -> RunResult:
        """What the run gave: each sample's tokens and text, the prompts, the figures."""
        tok = self.tokenizer

        def text_of(r, s) -> str:
            st = texts.get((r.index, s.index))
            # Cut before a stop string; else the whole decode, once.
            return st.output if st is not None and st.end is not None else tok.decode(s.generated)

        outputs = [
            [SampleResult(list(s.generated), text_of(r, s), s.finish_reason or "pending", s.error) for s in r.samples]
            for r in requests
        ]
        prompts = [p.text for p in self.built] or [tok.decode(p) for p in self.prompts]
        messages = [p.messages for p in self.built]
        return RunResult(requests, outputs, stats, prompts, complete, messages, failed,
                         self.kv_bytes(stats.peak_cells, stats.peak_window_cells), blas.in_use())

    def kv_bytes(self, cells: int, window_cells: int = 0) -> KVBytes:
        """What `cells` cells of this job's cache hold in K/V, beside float16's figure for them;
        `window_cells`: what its sliding-window layers' tables hold, where the layout keeps them
        apart (the cell layout: BatchControl.cells_by_window)."""
        batch = self.cache.as_batch_control()
        apart = batch is not None and any(batch.cells_by_window())  # a table of their own for window layers
        return KVBytes.of(cache_config(self.cfg, self.args, self.kv_dtype), cells, window_cells if apart else None)

    def _save(self, directory, requests, engine, stats, complete: bool):
        """Save the run's state (`resume.save_run`); None, or the SaveFailed saying why it was not."""
        from kvlayout.runner import resume

        try:
            resume.save_run(directory, self, requests, engine, stats, complete)
        except SaveFailed as exc:
            return exc
        return None


def model_source(cfg: RunConfig):
    """The directory the config's model is loaded from (its identity: `resume.model_files`):
    a real preset's cached one, or the config's; None for a seeded preset, built in memory."""
    from kvlayout.models.presets import FETCHED

    if cfg.model.preset in FETCHED:
        return FETCHED[cfg.model.preset]()
    return cfg.model_dir()


def prepare(cfg: RunConfig, loaded=None, resume=None, world: World | None = None) -> Job:
    """Resolve the layout, load the model, check every request fits, build the cache.

    `loaded` reuses a (model, args, tokenizer, name) from `load_model_for`, as it is; without it the
    config's model is loaded, or its `model.fallback` when it cannot be had (`Job.notices`
    says so), and dequantized as [model] says (`dequantize_as_configured`). Every user error
    (layout not installed, model directory, a chat the model cannot render, capacity) is raised
    here, before anything is generated. `resume` (a directory `generate(save_state=)`
    wrote) loads the cache and the run's state from it instead of starting
    afresh; StateError when it was saved by a run with another config.

    `world` (a tensor-parallel run's, `kvlayout.distributed.current()`): the model is split
    over its ranks (`models.shard`; ConfigError when its heads do not divide) and the cache
    holds this rank's KV heads only; every rank's prompts must be rank 0's (DistributedError).
    """
    world = world or World()
    builder = registry.resolve(cfg.layout.backend, cfg.layout.kind)  # LayoutNotFound before loading
    skipped = registry.notices()  # plugins that failed to load: said once the run's own layout resolved
    notices: list[str] = []
    if loaded is None:
        cfg, loaded, notices = load_with_fallback(cfg)
    model, args, tok, name = loaded
    if world.distributed:
        # A rank that loaded another model (its own fallback, another directory) would pair its
        # all_sums with the others' and compute garbage, or wait forever: said here, naming it.
        world.same_everywhere(json.dumps([name, attrs.asdict(args)], sort_keys=True, default=str).encode(),
                              f"the model ({name}, as its config.json reads)")
        check_shardable(args, world.size, name, model)
        if shards_of(model) != world.size:  # a model handed in twice is split once
            shard_model(model, world.group)
        model = RankedModel(model, world)
        args = local_args(args, world.size)
    built, joined = build_prompts(cfg, tok, args.vocab_size)
    if joined:  # only where the run asked for it (cfg.plain_chat), and said here
        if notices:
            notices = [f"{notices[0]} (it has no chat template: the chats go to it as plain text)"]
        else:
            notices = [f"{name} has no chat template; chat messages are sent as plain text"]
    prompts = [p.ids for p in built]
    world.same_everywhere(json.dumps(prompts).encode(), "the prompts' token ids")
    check_capacity(cfg, prompts)
    kv_dtype = default_kv_dtype(model.dtype) if cfg.cache.kv_dtype == "auto" else cfg.cache.kv_dtype
    job = Job(cfg, builder, model, args, tok, name, prompts, kv_dtype, None, None, built, skipped + notices, world)
    if resume is not None:
        from kvlayout.runner import resume as resuming

        job.resumed, job.cache = resuming.load_run(
            resume, job.fingerprint(), cache_config(cfg, args, kv_dtype), args.vocab_size, tok.eos_ids, name
        )
        # Each rank resumes its own directory: they must hold one run, saved at one step.
        world.same_everywhere(
            json.dumps([job.resumed.data["samples"], job.resumed.data["engine"]], sort_keys=True, default=str).encode(),
            "the saved run's samples and engine state",
        )
    else:
        job.cache = builder.build(cache_config(cfg, args, kv_dtype))
    check_faces(f"{builder.key} ({builder.provider()})", job.cache)
    if job.resumed is not None:
        job.check_resume()  # the engine's state against the cache, and the seal: still before anything runs
    return job


def check_faces(key: str, cache: Any) -> None:
    """The face the runner will drive exists and has every member of its contract; else one line.

    A third-party layout written against an older contract (a SequenceControl
    without `max_step`, say) is refused here, naming what it lacks, not by an
    AttributeError in the middle of a run.
    """
    for protocol, method in ((BatchControl, "as_batch_control"), (SequenceControl, "as_control")):
        try:
            face = getattr(cache, method, lambda: None)()
        except Exception as exc:  # a layout's bug, named rather than a traceback
            raise KVLayoutError(f"layout {key}: its {method}() raised {type(exc).__name__}: {exc}") from exc
        if face is not None:
            missing = [m for m in contract(protocol) if not hasattr(face, m)]
            if missing:
                raise KVLayoutError(f"layout {key}: its {protocol.__name__} face lacks {', '.join(missing)}")
            return
    raise KVLayoutError(f"layout {key} offers neither a batch nor a sequence control face; the runner cannot drive it")


def run(cfg: RunConfig, progress: OnProgress | None = None, loaded=None) -> RunResult:
    """Generate every request of `cfg`; `loaded` reuses a (model, args, tokenizer, name)."""
    return prepare(cfg, loaded).generate(progress)
