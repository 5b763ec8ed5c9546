"""`kvlayout run --save-state DIR` / `--resume DIR`: a run's state on disk, and back.

DIR holds two files, each written atomically (`kvlayout.persist.write_atomic`):

- `cache-<id>.safetensors`: the cache, by `cache.save` (a fresh name each time);
- `run.json`: which cache file goes with it (name and sha256 of its bytes),
  the run's fingerprint (layout, cache and model sections, sampling, engine,
  every request's prompt ids, max_tokens, n and stop strings, the storage dtype), every
  sample's tokens so far, finish reason and RNG state, the statistics, and
  the engine's own state, as `engine.state()` gives it (`engine.restore`
  puts it back: this module never looks inside an engine).

The cache file is written first, then `run.json` pointing at it, then older
cache files are removed: a crash at any point leaves a `run.json` whose cache
file is whole. The state is taken between two steps (or after a forward that
was aborted), where the engine and the cache agree; `--resume` refuses
(StateError) a directory saved by a run with another config, or a cache file
that does not match its `run.json`.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from pathlib import Path
from typing import Any

import attrs

from kvlayout.errors import KVLayoutError, StateError
from kvlayout.faces import Persistent
from kvlayout.persist import load as load_cache
from kvlayout.persist import write_atomic

RUN_FILE = "run.json"
RUN_FORMAT = 1


def fingerprint(cfg: Any, prompts: list[list[int]], kv_dtype: str) -> dict:
    """What a resumed run must share with the saved one, as plain JSON."""
    model_dir = cfg.model_dir()
    fp = {
        "layout": cfg.layout.key,
        "cache": attrs.asdict(cfg.cache),
        "kv_dtype": kv_dtype,
        "model": {
            "path": None if model_dir is None else str(model_dir),
            "preset": cfg.model.preset,
            "dtype": cfg.model.dtype,
            "seed": cfg.model.seed,
        },
        "sampling": attrs.asdict(cfg.sampling),
        "engine": attrs.asdict(cfg.engine),
        "requests": [
            # stop only where given, so runs saved before requests had stop strings still resume
            {"prompt_ids": list(p), "max_tokens": r.max_tokens, "n": r.n, **({"stop": list(r.stop)} if r.stop else {})}
            for r, p in zip(cfg.requests, prompts)
        ],
    }
    return json.loads(json.dumps(fp))


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def writable_dir(directory: str | Path) -> Path:
    """`directory`, created if needed; StateError (one line) when it cannot be. The CLI asks
    before a run starts, so a bad --save-state never costs the run it was meant to keep."""
    d = Path(directory)
    try:
        d.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StateError(f"--save-state {d}: cannot create the directory ({exc.strerror or exc})") from None
    if not os.access(d, os.W_OK):
        raise StateError(f"--save-state {d}: the directory is not writable")
    return d


def save_run(directory: str | Path, job: Any, requests: list, engine: Any, stats: Any, complete: bool) -> Path:
    """Write the cache and `run.json` into `directory` (created if needed); its path."""
    d = writable_dir(directory)
    if not isinstance(job.cache, Persistent):
        raise KVLayoutError(f"layout {job.builder.key} cannot save its cache; --save-state needs one that can")
    name = f"cache-{uuid.uuid4().hex[:12]}.safetensors"
    job.cache.save(d / name)
    data = {
        "format": RUN_FORMAT,
        "complete": complete,
        "cache_file": name,
        "cache_sha256": _sha256(d / name),
        "fingerprint": fingerprint(job.cfg, job.prompts, job.kv_dtype),
        "samples": [
            [
                {
                    "generated": list(s.generated),
                    "finish_reason": s.finish_reason,
                    "error": s.error,
                    "rng": s.rng.bit_generator.state,
                }
                for s in r.samples
            ]
            for r in requests
        ],
        "stats": attrs.asdict(stats),
        "engine": engine.state(),
    }
    path = write_atomic(d / RUN_FILE, [json.dumps(data, indent=1).encode()])
    for old in d.glob("cache-*.safetensors"):
        if old.name != name:
            old.unlink(missing_ok=True)
    return path


@attrs.define
class RunState:
    """A saved run, checked against the resuming one; `apply_*` put it back."""

    directory: Path
    data: dict

    def refuse(self, what: str) -> StateError:
        return StateError(f"--resume {self.directory}: {what}")

    def apply_samples(self, requests: list, stats_cls: type) -> Any:
        """Restore every sample's tokens, finish reason and RNG; the saved Stats. StateError
        naming the file when they are not what `save_run` wrote."""
        try:
            saved = self.data["samples"]
            for r, samples in zip(requests, saved, strict=True):
                for s, d in zip(r.samples, samples, strict=True):
                    s.generated = [int(t) for t in d["generated"]]
                    s.finish_reason, s.error = d["finish_reason"], d["error"]
                    s.rng.bit_generator.state = d["rng"]
            return stats_cls(**self.data["stats"])
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise self.damaged(exc) from None

    def damaged(self, exc: Exception) -> StateError:
        return self.refuse(f"{RUN_FILE} is damaged ({type(exc).__name__}: {exc}); save the run again")

    def done_tokens(self, requests: list) -> int:
        """Progress already made: planned tokens of finished samples, tokens of the others."""
        return sum(
            r.max_tokens if s.finish_reason is not None else len(s.generated) for r in requests for s in r.samples
        )

    def restore_engine(self, engine: Any, requests: list) -> None:
        """Put the engine back where it stopped (`engine.restore`); StateError naming this
        directory when the saved state is another engine's or disagrees with the cache."""
        try:
            engine.restore(self.data["engine"], requests)
        except StateError as exc:
            raise self.refuse(str(exc)) from None
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
            raise self.damaged(exc) from None


def load_run(directory: str | Path, fp: dict, config: Any) -> tuple[RunState, Any]:
    """The saved run in `directory` and its cache; StateError unless it matches `fp` and `config`."""
    d = Path(directory)
    path = d / RUN_FILE
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise StateError(f"--resume {d}: no {RUN_FILE} there; was it written by --save-state?") from None
    except (OSError, ValueError) as exc:
        raise StateError(f"--resume {d}: {RUN_FILE} cannot be read ({exc})") from None
    state = RunState(d, data)
    if not isinstance(data, dict) or data.get("format") != RUN_FORMAT:
        got = data.get("format") if isinstance(data, dict) else None
        raise state.refuse(f"{RUN_FILE} format {got!r}; this kvlayout reads {RUN_FORMAT}")
    saved_fp = data.get("fingerprint")
    if saved_fp != fp:
        keys = sorted(k for k in set(fp) | set(saved_fp or {}) if (saved_fp or {}).get(k) != fp.get(k))
        raise state.refuse(
            f"saved by a run with another config (differs in: {', '.join(keys)}); "
            "resume with the config and model it was saved with"
        )
    cache_path = d / str(data.get("cache_file"))
    if not cache_path.is_file() or _sha256(cache_path) != data.get("cache_sha256"):
        raise state.refuse(f"the cache file {cache_path.name} is missing or is not the one {RUN_FILE} names")
    return state, load_cache(cache_path, config=config)
