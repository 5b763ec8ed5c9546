"""What a running server holds: the prepared model and cache, its limits, the engine thread.

`prepare_service` does everything that can fail on the user's side before
the server binds a port: the config's layout resolved, its model loaded (or
its fallback, said), the cache built (`runner.job.prepare`, as `kvlayout
run` does). `Service.order_request` turns a checked `Order` into the engine's
`Request`, with its own sampling and one seeded generator per sample.

Call it on the thread that will run the engine (`Worker.run`): MLX's
streams belong to the thread that made them, and an array still to be
computed cannot be evaluated on another, so the model is loaded and the
cache built where they will be used. `kvlayout serve` runs the engine on
the main thread and HTTP on a thread of its own (`serve`).
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import signal
import time
from typing import Any

import attrs
import numpy as np

from kvlayout.distributed import World
from kvlayout.engines.prefix_store import PrefixStore
from kvlayout.engines.prefixes import PrefixCache
from kvlayout.engines.records import Request, Sample, Sampling, ignore_tokens
from kvlayout.errors import ConfigError
from kvlayout.grammar import Grammars
from kvlayout.models.tokenizer import sampling_defaults
from kvlayout.registry import plugin_manager
from kvlayout.runner.job import Job, model_source, prepare
from kvlayout.server import cellmap
from kvlayout.server.config import ServeConfig
from kvlayout.server.observer import CellObserver
from kvlayout.server.replica import Leading, follow
from kvlayout.server.requests import Limits, Order
from kvlayout.server.worker import Worker

logger = logging.getLogger("kvlayout.server")


@attrs.define(eq=False)
class Service:
    cfg: ServeConfig
    job: Job
    model_id: str
    limits: Limits
    worker: Worker
    created: int
    notices: list[str]
    counter: Any = attrs.field(factory=itertools.count)
    grammars: Any = None  # kvlayout.grammar.Grammars over the model's tokenizer: response_format's compiler

    def follow(self) -> None:
        """A tensor-parallel server's rank other than 0: replay rank 0's engine until it stops.

        Ctrl-C reaches every rank of a launch; rank 0 alone decides when the server stops (its
        grace period, then its last message), so the others ignore it."""
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        job, prefixes, cap = self.job, self.worker.prefixes, self.worker.max_sequences
        follow(job.world, lambda stats: job.make_engine(stats, lambda n: None, ignore_tokens, prefixes, cap),
               self.worker.clear, job.tokenizer.decode)

    def close(self) -> None:
        """The server is done: its observer leaves the plugin manager."""
        observer = self.worker.observer
        if observer is not None and plugin_manager().is_registered(observer):
            plugin_manager().unregister(observer)

    @property
    def tokenizer(self):
        return self.job.tokenizer

    def order_request(self, order: Order, isolation: str = "") -> Request:
        """The engine's record of `order`: a fresh index, the order's sampling, a generator per sample.

        With a `seed` the samples are reproducible (OpenAI's meaning); without one each request
        draws from its own index, so two unseeded requests do not sample alike. `isolation`: its
        prefix-cache tenant (server.auth.isolation_key: its API key's and cache_salt's hash)."""
        index = next(self.counter)
        sampling = Sampling(order.temperature, order.top_p, order.seed, order.presence_penalty,
                            order.frequency_penalty, order.logit_bias, order.logprobs)
        key = [order.seed] if order.seeded else [order.seed, index]
        samples = [Sample(index, j, np.random.default_rng([*key, j])) for j in range(order.n)]
        if order.grammar is not None:  # each sample walks the grammar on its own
            for sample in samples:
                sample.constraint = order.grammar.matcher()
        score = order.logprobs if order.echo is not None else None  # echo with logprobs: the prompt's own too
        # max_tokens 0 (echo: the prompt scored, nothing generated): the one token its last logits give, left out
        return Request(index, list(order.prompt), max(order.max_tokens, 1), order.n, samples, sampling=sampling,
                       isolation=isolation, score_prompt=score)


def model_id_of(cfg: ServeConfig) -> str:
    """The id clients name in `model`: the preset's name, or the model directory's."""
    if cfg.model.preset is not None:
        return cfg.model.preset
    return cfg.model_dir().name


def cells_held(batch: Any, control: Any) -> dict[str, int]:
    """The cells held now, of how many (a BatchControl's, else a SequenceControl's); a cell layout's
    sliding-window layers' own (the largest window table's, BatchControl.cells_by_window) as
    `window_used`."""
    if batch is None:
        return {"capacity": control.capacity, "used": control.length, "free": control.capacity - control.length}
    used, windows = batch.capacity - batch.free_cells, batch.cells_by_window()
    out = {"capacity": batch.capacity, "used": used, "free": batch.free_cells}
    if any(windows):
        out["window_used"] = max(n for w, n in windows.items() if w)
    return out


def prepare_service(cfg: ServeConfig, loaded=None, world: World | None = None) -> Service:
    """Load and build everything (ConfigError and friends, one line each, before any port is bound).

    `loaded` reuses a (model, args, tokenizer, name), as `runner.job.prepare` takes it. `world`: a
    tensor-parallel server's ranks (rank 0 serves; the others `follow`, server.replica); every
    rank must have read the same config."""
    world = world or World()
    # Where a rank started (base_dir) may differ; what it serves may not.
    shape = attrs.asdict(cfg, filter=lambda a, v: a.name != "base_dir")
    world.same_everywhere(json.dumps(shape, sort_keys=True, default=str).encode(), "the server's config")
    job = prepare(cfg, loaded, world=world)
    # The fallback's config, when the config's model could not be had; its sampling defaults resolved
    # (the config's, else the model's generation_config.json's, else OpenAI's): what requests default to.
    cfg = job.cfg = attrs.evolve(job.cfg, sampling=job.cfg.sampling.resolved(sampling_defaults(model_source(job.cfg))))
    notices = list(job.notices)
    notices.append(f"requests that name no temperature sample at {cfg.sampling.temperature:g} (top_p "
                   f"{cfg.sampling.top_p:g}); send temperature 0, or set [sampling] temperature = 0, for greedy")
    if job.tokenizer.chat_template is None:
        notices.append(f"{job.model_name} has no chat template: chat messages are sent to it as plain text")
    batch = job.cache.as_batch_control()
    control = batch if batch is not None else job.cache.as_control()
    s = cfg.server
    prefixes = PrefixCache(batch, store=prefix_store_for(cfg, job, notices)) if batch is not None and s.prefix_cache \
        else None

    def clear() -> None:  # after a step that raised: the cache emptied, the kept prefixes with it
        control.clear()
        if prefixes is not None:
            prefixes.forget()

    view = cellmap.cell_view(job.cache)
    observer = CellObserver() if view is not None else None  # the cell map hears the layout's step hooks
    made: list[Any] = []

    def make_engine(stats, heard):
        engine = job.make_engine(stats, lambda n: None, heard, prefixes, s.max_sequences)
        if world.distributed and world.leader:  # the other ranks replay what this engine is asked to do
            engine = Leading(engine, world, fresh=bool(made))
        made.append(engine)
        return engine

    worker = Worker(
        make_engine, functools.partial(cells_held, batch, control), s.max_sequences, s.queue, clear, prefixes,
        view, observer,
        idle=lambda: made[-1].idle() if world.distributed else None,  # only rank 0's worker runs
        stopped=lambda: made[-1].finish() if world.distributed else None,
    )
    if observer is not None:  # registered last: nothing that can fail after it leaves it behind
        plugin_manager().register(observer, name=observer.name)
    limits = limits_of(cfg, job)
    return Service(cfg, job, limits.model_id, limits, worker, int(time.time()), notices,
                   grammars=grammars_for(job, notices))


def limits_of(cfg: ServeConfig, job: Job) -> Limits:
    """What every request is checked against: the served model, the cache, [server]'s limits, the
    sampling defaults (resolved already: ServeSampling.resolved)."""
    s = cfg.server
    return Limits(model_id=model_id_of(cfg), capacity=cfg.cache.capacity, max_tokens=s.max_tokens,
                  max_n=s.max_sequences, vocab_size=job.args.vocab_size, temperature=cfg.sampling.temperature,
                  top_p=cfg.sampling.top_p, seed=cfg.sampling.seed)


def store_identity(cfg: ServeConfig, job: Job) -> dict:
    """What a stored prefix is valid for: the model (its files' hashes: weights, tokenizer, chat template;
    a preset's name, seed and dtype), the layout, the K/V dtype and quantization group."""
    from kvlayout.runner import resume

    source = model_source(job.cfg)
    return {
        "model": {"preset": cfg.model.preset, "seed": cfg.model.seed, "dtype": cfg.model.dtype,
                  "files": None if source is None else resume.model_files(source),
                  "loaded_as": job.model_name},  # says how the weights were loaded (dequantized to what)
        "layout": cfg.layout.key,
        "kv_dtype": job.kv_dtype,
        "kv_group_size": job.cache.config.kv_group_size,
    }


def prefix_store_for(cfg: ServeConfig, job: Job, notices: list[str]) -> PrefixStore | None:
    """The prefix store `server.prefix_store` names (None: none), over the job's cache; what it has to say
    (a directory it cannot write, entries of another model) goes to the server's log, one line each."""
    directory = cfg.prefix_store_dir()
    if directory is None:
        return None
    if job.world.distributed:  # each rank holds its own heads' K/V, and each would load on its own
        notices.append("server.prefix_store is off: a tensor-parallel server keeps its prefixes in cells only")
        return None
    if not hasattr(job.cache, "load_seq"):
        notices.append(f"server.prefix_store is off: the layout {cfg.layout.key} cannot save one sequence")
        return None
    store = PrefixStore(directory, cfg.server.prefix_store_bytes, store_identity(cfg, job), job.cache,
                        lambda line: logger.warning("kvlayout: prefix store: %s", line))
    notices.append(f"prefixes are kept in {directory} too ({store.snapshot()['entries']} stored)")
    return store


def grammars_for(job: Job, notices: list[str]) -> Grammars | None:
    """response_format's compiler over the model's tokenizer (llguidance builds its view on the first
    schema); None, said in `notices`, for a model it cannot constrain (no end-of-sequence id)."""
    try:
        return Grammars(job.tokenizer, job.args.vocab_size, job.tokenizer.eos_ids)
    except ConfigError as exc:
        notices.append(f"structured output (response_format json_object / json_schema) is off: {exc}")
        return None
