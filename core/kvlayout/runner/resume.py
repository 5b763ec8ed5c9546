"""`kvlayout run --save-state DIR` / `--resume DIR`: a run's state on disk, and back.

DIR holds two files, each written atomically (`kvlayout.persist.write_atomic`):

- `cache-<id>.safetensors`: the cache, by `cache.save` (a fresh name each time);
- `run.json`: which cache file goes with it (name and sha256 of its bytes),
  the run's fingerprint (layout, cache and model sections, the model's files
  by sha256, sampling, engine, every request's prompt ids, max_tokens, n and
  stop strings, the storage dtype), every sample's tokens so far, finish
  reason and RNG state, the statistics, the engine's own state, as
  `engine.state()` gives it (`engine.restore` puts it back: this module never
  looks inside an engine), and last `sha256`, over all of that.

The cache file is written first, then `run.json` pointing at it, then older
cache files are removed: a crash at any point leaves a `run.json` whose cache
file is whole. A Ctrl-C while saving is held (`interrupt.held_while_saving`);
a second one abandons the save, which then leaves the previous `run.json` as
it was. Either way `save_run` says which: it returns, or raises SaveFailed
naming what DIR holds now.

`--resume` reads everything before anything is applied: the format; every
field of `run.json`, each refusal a StateError naming it by its path
(`samples[0][1].generated[3]`); the fingerprint against the resuming run's
(a changed config, layout, dtype or model is named); the cache file, a plain
name in DIR whose sha256 matches; then the cache itself (`kvlayout.load`),
the engine's state against it (`Job.check_resume`) and last the seal, so
an edit that leaves every field plausible is refused too.
"""

from __future__ import annotations

import hashlib
import json
import re
import tempfile
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import attrs

from kvlayout.engines import saved
from kvlayout.engines.records import Stats
from kvlayout.errors import KVLayoutError, SaveFailed, StateError, one_line, os_reason
from kvlayout.faces import Persistent
from kvlayout.persist import load as load_cache
from kvlayout.persist import write_atomic
from kvlayout.runner.interrupt import held_while_saving

RUN_FILE = "run.json"
RUN_FORMAT = 2  # 2: the model's files in the fingerprint, fields checked, the seal
FIELDS = ("format", "complete", "cache_file", "cache_sha256", "fingerprint", "samples", "stats", "engine", "sha256")
CACHE_NAME = re.compile(r"cache-[0-9a-f]{12}\.safetensors")
SHA256 = re.compile(r"[0-9a-f]{64}")
FINISH_REASONS = (None, "stop", "length", "error")
# The files that make a model directory's model, as its loaders read them (kvlayout.models): the
# weights, config.json (and generation_config.json's EOS ids), the tokenizer and its chat template.
MODEL_FILES = (
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"
)


def model_files(directory: Path) -> dict[str, str]:
    """The sha256 of each file of the model in `directory` that its loaders read, by name.

    Its identity: the weights hash at about 1.7 GB/s (0.06 s for SmolLM2's 98 MB, page-cached),
    taken once per run and only when it saves or resumes.
    """
    names = [n for n in MODEL_FILES if (directory / n).is_file()]
    names += sorted(p.name for p in directory.glob("*.safetensors") if p.is_file())
    return {name: _sha256(directory / name) for name in names}


def fingerprint(cfg: Any, prompts: list[list[int]], kv_dtype: str, files: dict[str, str] | None = None) -> dict:
    """What a resumed run must share with the saved one, as plain JSON. `files`: the model's
    (`model_files`) when it comes from a directory; a preset without one is its name and seed."""
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
            "files": files,
        },
        "sampling": attrs.asdict(cfg.sampling),
        "engine": attrs.asdict(cfg.engine),
        "requests": [
            {"prompt_ids": list(p), "max_tokens": r.max_tokens, "n": r.n, "stop": list(r.stop)}
            for r, p in zip(cfg.requests, prompts)
        ],
    }
    return json.loads(json.dumps(fp))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:  # in 1 MiB reads: hashlib.file_digest is Python 3.11's
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _seal(data: dict) -> str:
    """The sha256 of `data` without its own `sha256`, as canonical JSON."""
    body = {k: v for k, v in data.items() if k != "sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


# -- saving --------------------------------------------------------------------------------


def writable_dir(directory: str | Path) -> Path:
    """`directory`, created if needed, once a file could be written in it; StateError (one line)
    when it cannot. The CLI asks before a run starts, so a bad --save-state never costs the run
    it was meant to keep."""
    if not str(directory):
        raise StateError("--save-state: expected a directory, got an empty name")
    d = Path(directory)
    try:
        d.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        raise StateError(f"--save-state {d}: exists and is not a directory") from None
    except OSError as exc:
        raise StateError(f"--save-state {d}: cannot create the directory ({os_reason(exc)})") from None
    try:  # the real test: permissions, a read-only file system, root or not
        with tempfile.NamedTemporaryFile(dir=d, prefix=".kvlayout-probe-"):
            pass
    except OSError as exc:
        raise StateError(f"--save-state {d}: the directory is not writable ({os_reason(exc)})") from None
    if (d / RUN_FILE).exists() and not (d / RUN_FILE).is_file():
        raise StateError(f"--save-state {d}: {d / RUN_FILE} exists and is not a file")
    return d


def ready_to_save(directory: str | Path, job: Any) -> Path:
    """Everything a save needs that can be had before the first step: the directory (writable_dir),
    a layout that can save its cache, and the model's identity (hashed now, from the files the run
    loaded, not from whatever is there when it ends)."""
    d = writable_dir(directory)
    if not isinstance(job.cache, Persistent):
        raise KVLayoutError(f"layout {job.builder.key} cannot save its cache; --save-state needs one that can")
    job.fingerprint()
    return d


def holds(directory: Path) -> str:
    """What `directory` holds for --resume, in words (after a save that did not happen)."""
    if (directory / RUN_FILE).is_file():
        return f"{directory} keeps the state saved before"
    return f"nothing is saved in {directory}"


def _names(directory: Path, cache_name: str) -> bool:
    """Does `directory`'s run.json name `cache_name` (was a save done, interrupted or not)?"""
    try:
        return json.loads((directory / RUN_FILE).read_text()).get("cache_file") == cache_name
    except (OSError, ValueError, AttributeError):
        return False


def save_run(directory: str | Path, job: Any, requests: list, engine: Any, stats: Any, complete: bool) -> Path:
    """Write the cache and `run.json` into `directory` (created if needed); the run.json path.

    SaveFailed when it cannot be written (the reason, then what `directory` holds: its previous
    state, untouched, or nothing), or when a second Ctrl-C abandons it (the first is held:
    `interrupt.held_while_saving`).
    """
    d = Path(directory)
    name = f"cache-{uuid.uuid4().hex[:12]}.safetensors"
    try:
        with held_while_saving(f"kvlayout: saving the state to {d}; Ctrl-C again abandons it ({holds(d)})"):
            if not isinstance(job.cache, Persistent):
                raise KVLayoutError(f"layout {job.builder.key} cannot save its cache")
            d.mkdir(parents=True, exist_ok=True)
            engine.settle()  # tokens in flight are recorded before the samples are read
            job.cache.save(d / name)
            data = {
                "format": RUN_FORMAT,
                "complete": complete,
                "cache_file": name,
                "cache_sha256": _sha256(d / name),
                "fingerprint": job.fingerprint(),
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
            data["sha256"] = _seal(data)
            path = write_atomic(d / RUN_FILE, [json.dumps(data, indent=1).encode()])
    except (OSError, KVLayoutError, KeyboardInterrupt) as exc:
        if not _names(d, name):  # else it was saved, and the Ctrl-C came as it finished
            try:
                (d / name).unlink(missing_ok=True)  # a cache file no run.json names
            except OSError:
                pass
            if isinstance(exc, KeyboardInterrupt):
                raise SaveFailed(f"--save-state {d}: saving was abandoned (Ctrl-C); {holds(d)}", True) from None
            why = os_reason(exc) if isinstance(exc, OSError) else one_line(exc)
            where = f" ({exc.filename})" if isinstance(exc, OSError) and exc.filename else ""
            raise SaveFailed(f"--save-state {d}: the state was not saved: {why}{where}; {holds(d)}") from None
        path = d / RUN_FILE
    for old in d.glob("cache-*.safetensors"):
        if old.name != name:
            try:
                old.unlink(missing_ok=True)
            except OSError:  # left for the next save to remove
                pass
    return path


# -- resuming ------------------------------------------------------------------------------


@attrs.define
class RunState:
    """A saved run, every field checked against the resuming one; `apply_*` put it back."""

    directory: Path
    data: dict

    def refuse(self, what: str) -> StateError:
        return StateError(f"--resume {self.directory}: {what}")

    def damaged(self, what: str) -> StateError:
        return self.refuse(f"{RUN_FILE} is damaged: {what}")

    def apply_samples(self, requests: list, stats_cls: type = Stats) -> Any:
        """Restore every sample's tokens, finish reason and RNG (checked by `load_run`); the saved Stats."""
        for r, samples in zip(requests, self.data["samples"], strict=True):
            for s, d in zip(r.samples, samples, strict=True):
                s.generated = list(d["generated"])
                s.finish_reason, s.error = d["finish_reason"], d["error"]
                s.rng.bit_generator.state = d["rng"]
        return stats_cls(**self.data["stats"])

    def done_tokens(self, requests: list) -> int:
        """Progress already made: planned tokens of finished samples, tokens of the others."""
        return sum(
            r.max_tokens if s.finish_reason is not None else len(s.generated) for r in requests for s in r.samples
        )

    def restore_engine(self, engine: Any, requests: list) -> None:
        """Put the engine back where it stopped (`engine.restore`); StateError naming the field of
        `engine` when the saved state is another engine's or disagrees with the samples or the cache."""
        try:
            engine.restore(self.data["engine"], requests)
        except StateError as exc:
            raise self.damaged(f"engine.{exc}") from None

    def check_seal(self) -> None:
        """Last: `sha256` matches everything else, so an edit that left each field plausible is refused."""
        if self.data["sha256"] != _seal(self.data):
            raise self.refuse(
                f"{RUN_FILE} was changed after it was saved (its sha256 does not match its contents); "
                "it cannot be resumed"
            )


def load_run(
    directory: str | Path,
    fp: dict,
    config: Any,
    vocab_size: int,
    eos: Iterable[int] = (),
    model_name: str | None = None,
) -> tuple[RunState, Any]:
    """The saved run in `directory` and its cache; StateError, before anything is applied, unless
    every field of run.json is what `save_run` writes for a run with fingerprint `fp` (a model of
    `vocab_size` tokens ending samples on `eos`, called `model_name` in its statistics) and the
    cache file is the one it names, for `config`."""
    d = _resume_dir(directory)
    state = RunState(d, _read_run_file(d))
    name = _check_run_file(state, fp, vocab_size, frozenset(eos), model_name)
    return state, _load_cache_file(state, name, config, fp["layout"])


def _resume_dir(directory: str | Path) -> Path:
    """`directory`, once it names a directory that exists."""
    if not str(directory):
        raise StateError("--resume: expected a directory, got an empty name")
    d = Path(directory)
    if not d.is_dir():
        raise StateError(f"--resume {d}: {'not a directory' if d.exists() else 'no such directory'}")
    return d


def _read_run_file(d: Path) -> Any:
    """The JSON in `d`'s run.json, whatever it holds; StateError when there is none or it is not JSON."""
    path = d / RUN_FILE
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise StateError(f"--resume {d}: no {RUN_FILE} there; was it written by --save-state?") from None
    except OSError as exc:
        raise StateError(f"--resume {d}: {RUN_FILE} cannot be read ({os_reason(exc)})") from None
    except ValueError as exc:  # not JSON, or not UTF-8
        raise StateError(f"--resume {d}: {RUN_FILE} is damaged: not JSON ({exc})") from None


def _check_run_file(state: RunState, fp: dict, vocab_size: int, eos: frozenset[int], model_name: str | None) -> str:
    """Every field of `state`'s run.json checked (see `load_run`); the name of the cache file it names."""
    data = state.data
    if not isinstance(data, dict):
        raise state.damaged(f"expected an object, got {saved.kind(data)}")
    if data.get("format") != RUN_FORMAT:
        raise state.refuse(
            f"{RUN_FILE} format {saved.shown(data.get('format'))}; this kvlayout reads format {RUN_FORMAT} "
            "(a state saved by another version cannot be resumed: run again from the start)"
        )
    try:
        saved.table(data, "", FIELDS)
        _check_fingerprint(state, data["fingerprint"], fp)
        _check_samples(data["samples"], fp["requests"], vocab_size, eos)
        _check_stats(data["stats"], {"layout": fp["layout"], "kv_dtype": fp["kv_dtype"], "model": model_name})
        _check_complete(data)
        if not isinstance(data["engine"], dict):
            raise saved.refuse("engine", f"expected an object, got {saved.kind(data['engine'])}")
        name = saved.text(data["cache_file"], "cache_file")
        if not CACHE_NAME.fullmatch(name):
            raise saved.bad(
                "cache_file", name,
                "the name of a cache file --save-state writes in the directory (cache-<12 hex digits>.safetensors)",
            )
        if not SHA256.fullmatch(saved.text(data["cache_sha256"], "cache_sha256")):
            raise saved.bad("cache_sha256", data["cache_sha256"], "64 hex digits")
        saved.text(data["sha256"], "sha256")
    except StateError as exc:
        if str(exc).startswith("--resume"):
            raise
        raise state.damaged(str(exc)) from None
    return name


def _check_complete(data: dict) -> None:
    """`complete` is true exactly when every sample is finished."""
    unfinished = [
        f"samples[{i}][{j}]"
        for i, row in enumerate(data["samples"])
        for j, s in enumerate(row)
        if s["finish_reason"] is None
    ]
    if saved.flag(data["complete"], "complete") == bool(unfinished):
        raise saved.refuse(
            "complete",
            f"{data['complete']}, but {unfinished[0]} is unfinished" if unfinished
            else "false, but every sample is finished",
        )


def _load_cache_file(state: RunState, name: str, config: Any, layout: str) -> Any:
    """The cache in the file `name` of the run's directory, once its sha256 is the one run.json names."""
    d = state.directory
    cache_path = d / name
    if not cache_path.is_file():
        raise state.refuse(f"the cache file {name} that {RUN_FILE} names is not in {d}")
    if _sha256(cache_path) != state.data["cache_sha256"]:
        raise state.refuse(
            f"the cache file {name} is not the one {RUN_FILE} names (its sha256 differs): changed or replaced"
        )
    try:
        return load_cache(cache_path, config=config, layout=layout)
    except StateError as exc:
        raise state.refuse(str(exc)) from None


def differences(saved_value: Any, value: Any, path: str = "", limit: int = 4) -> list[str]:
    """Where `saved_value` and `value` (plain JSON) differ, as paths with both values, at most `limit`."""
    if type(saved_value) is not type(value) or not isinstance(value, (dict, list)):
        if saved_value == value and type(saved_value) is type(value):
            return []
        return [f"{path or 'the whole'} (saved {saved.shown(saved_value, 40)}, now {saved.shown(value, 40)})"]
    out: list[str] = []
    if isinstance(value, dict):
        for k in sorted(set(saved_value) | set(value), key=str):
            if k not in value:
                out.append(f"{saved.at(path, k)} (saved, not in this run)")
            elif k not in saved_value:
                out.append(f"{saved.at(path, k)} (not saved)")
            else:
                out += differences(saved_value[k], value[k], saved.at(path, k), limit)
    elif len(saved_value) != len(value):
        out.append(f"{path} (saved {len(saved_value)} items, now {len(value)})")
    else:
        for i, (a, b) in enumerate(zip(saved_value, value)):
            out += differences(a, b, saved.at(path, i), limit)
    return out[:limit]


def _check_fingerprint(state: RunState, saved_fp: Any, fp: dict) -> None:
    diffs = differences(saved_fp, fp, limit=8)
    if not diffs:
        return
    files = "model.files."
    if all(p.startswith(files) for p in diffs):  # the same config, another model at the same path
        changed = [p[len(files) :].split(" (")[0] for p in diffs]
        model = fp["model"]
        which = f"in {model['path']}" if model["path"] else f"of preset {model['preset']!r}"
        raise state.refuse(
            f"the model {which} changed since the state was saved ({', '.join(changed)} "
            f"{'differs' if len(changed) == 1 else 'differ'}); resume with the model it was saved with"
        )
    raise state.refuse(
        f"saved by a run with another config (differs in: {'; '.join(diffs[:4])}); "
        "resume with the config, flags and model it was saved with"
    )


def _check_samples(value: Any, requests: list[dict], vocab_size: int, eos: frozenset[int]) -> None:
    rows = saved.array(value, "samples", length=len(requests))
    for i, (request, row) in enumerate(zip(requests, rows)):
        max_tokens = request["max_tokens"]
        for j, s in enumerate(saved.array(row, f"samples[{i}]", length=request["n"])):
            where = f"samples[{i}][{j}]"
            s = saved.table(s, where, ("generated", "finish_reason", "error", "rng"))
            generated = saved.array(s["generated"], f"{where}.generated")
            for k, t in enumerate(generated):
                if type(t) is not int or not 0 <= t < vocab_size:
                    raise saved.bad(f"{where}.generated[{k}]", t, f"a token id of this model (0 to {vocab_size - 1})")
                if t in eos:
                    raise saved.refuse(f"{where}.generated[{k}]", f"{t} ends a sample; a sample never keeps it")
            reason = saved.choice(s["finish_reason"], f"{where}.finish_reason", FINISH_REASONS)
            n = len(generated)
            fits = n == max_tokens if reason == "length" else n <= max_tokens if reason == "stop" else n < max_tokens
            if not fits:
                raise saved.refuse(
                    f"{where}.generated",
                    f"{n} token(s) with finish_reason {saved.shown(reason)} and max_tokens {max_tokens}",
                )
            if reason == "error":
                saved.text(s["error"], f"{where}.error")
            else:
                saved.choice(s["error"], f"{where}.error", (None,))
            _check_rng(s["rng"], f"{where}.rng")


def _check_rng(value: Any, where: str) -> None:
    """A numpy PCG64 state, as `Generator.bit_generator.state` gives it."""
    rng = saved.table(value, where, ("bit_generator", "state", "has_uint32", "uinteger"))
    saved.choice(rng["bit_generator"], f"{where}.bit_generator", ("PCG64",))
    inner = saved.table(rng["state"], f"{where}.state", ("state", "inc"))
    saved.integer(inner["state"], f"{where}.state.state", 0, 2**128 - 1)
    saved.integer(inner["inc"], f"{where}.state.inc", 0, 2**128 - 1)
    saved.integer(rng["has_uint32"], f"{where}.has_uint32", 0, 1)
    saved.integer(rng["uinteger"], f"{where}.uinteger", 0, 2**32 - 1)


# Stats fields added after states were first written: a state without them counted none (0).
LATER_STATS = ("drafted_tokens", "accepted_tokens")


def _check_stats(value: Any, expected: dict) -> None:
    """Stats' fields, each of its kind (counts and seconds >= 0), the names as this run's; one of
    LATER_STATS missing is filled in as 0 (a state saved before it existed)."""
    fields = attrs.fields(Stats)
    if isinstance(value, dict):
        for name in LATER_STATS:
            value.setdefault(name, 0)
    stats = saved.table(value, "stats", [f.name for f in fields])
    for f in fields:
        where, v = f"stats.{f.name}", stats[f.name]
        if isinstance(f.default, str):
            saved.text(v, where)
        elif isinstance(f.default, int):
            saved.integer(v, where, 0)
        else:
            saved.number(v, where, 0.0)
    for key, value in expected.items():
        if value is not None and stats[key] != value:
            raise saved.bad(f"stats.{key}", stats[key], f"{value!r}, this run's")
