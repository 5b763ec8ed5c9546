"""A --resume directory that is not what the run saved: refused by `prepare`, before anything
runs or is applied, with a StateError naming the field; the directory left byte for byte as it was.

The tables: every field of a real run.json (both engines) corrupted every way — missing, of
another type, out of range, a list one item short or long, an extra key — with its seal
recomputed, so the field checks alone must catch it; edits that leave every field plausible,
which the seal catches; the cache file missing, truncated, swapped or named outside the
directory; run.json itself unreadable. Then the issue's cases and bad directories through the
real command in a subprocess: exit 2, one line on stderr, no traceback, nothing run.
"""

from __future__ import annotations

import copy
import json
import math
import os
import shutil
import subprocess
import sys

import pytest

from kvlayout import StateError
from kvlayout.runner import job, resume
from tests.runner.conftest import QUESTIONS, SYSTEM, make_config, token_ids
from tests.runner.test_resume import stop_after

REQUESTS = [{"prompt": "Q: hi\nA:", "max_tokens": 2, "n": 2}] + [
    {"prompt": SYSTEM + q, "max_tokens": 6, "n": 2} for q in QUESTIONS
]
# Where each layout's run is stopped so that its state holds every kind of entry: finished
# samples; for the cell engine running sequences, a prompt prefilling for two samples and a
# queued request; for the seq engine the sample in the cache, after finished ones.
STOPS = {"mlx:cell": 6, "mlx:seq": 12}


def run_config(tiny_dir, layout):
    return make_config(
        tiny_dir, layout, requests=REQUESTS, sampling={"temperature": 0.8, "top_p": 0.9, "seed": 3},
        engine={"prefill_chunk": 16},
    )


@pytest.fixture(scope="module")
def saved_states(tmp_path_factory, tiny_dir, tiny_loaded):
    """layout -> a directory holding the state of a run stopped part way, saved once."""
    out = {}
    for layout, k in STOPS.items():
        d = tmp_path_factory.mktemp(layout.replace(":", "-"))
        job.prepare(run_config(tiny_dir, layout), loaded=tiny_loaded).generate(stop=stop_after(k), save_state=d)
        out[layout] = d
    return out


def files(d):
    """Everything under `d`, by relative path: a file's bytes, a directory as None."""
    return {str(p.relative_to(d)): None if p.is_dir() else p.read_bytes() for p in sorted(d.rglob("*"))}


class Replace:
    """What a damage returns to put another value in place of the whole of run.json."""

    def __init__(self, value):
        self.value = value


def reseal(data):
    """Recompute run.json's seal after an edit, as if the damage had been saved that way."""
    seal = getattr(resume, "_seal", None)
    if seal is not None and isinstance(data, dict) and "sha256" in data:
        data["sha256"] = seal(data)
    return data


def damaged_copy(tmp_path, saved_dir, damage, sealed=True):
    d = tmp_path / "state"
    shutil.copytree(saved_dir, d)
    data = json.loads((d / "run.json").read_text())
    out = damage(data)
    data = out.value if isinstance(out, Replace) else data
    (d / "run.json").write_text(json.dumps(reseal(data) if sealed else data))
    return d


def refused_naming(tmp_path, tiny_dir, tiny_loaded, layout, d, name):
    """prepare(resume=d) raises a StateError naming `name`, and leaves d as it was."""
    before = files(d)
    with pytest.raises(StateError) as info:
        job.prepare(run_config(tiny_dir, layout), loaded=tiny_loaded, resume=d)
    message = str(info.value)
    assert message.startswith(f"--resume {d}: "), message
    assert name in message, f"{name!r} not named in: {message}"
    assert "\n" not in message
    assert files(d) == before
    return message


# -- every field, every way ----------------------------------------------------------------

WRONG_TYPE = {dict: [], list: {}, str: 7, int: "7", float: "1.5", bool: 1, type(None): 7}


def path_of(keys):
    out = ""
    for k in keys:
        out = f"{out}[{k}]" if isinstance(k, int) else f"{out}.{k}" if out else k
    return out


def get(data, keys):
    for k in keys:
        data = data[k]
    return data


def setter(keys, value):
    def damage(data):
        get(data, keys[:-1])[keys[-1]] = copy.deepcopy(value)

    return damage


def deleter(keys):
    def damage(data):
        del get(data, keys[:-1])[keys[-1]]

    return damage


def resizer(keys, delta):
    def damage(data):
        items = get(data, keys)
        if delta < 0:
            items.pop()
        else:
            items.append(copy.deepcopy(items[-1]))

    return damage


def expected_name(keys, mutation):
    """What the refusal must name for a mutation at `keys`."""
    path = path_of(keys)
    if keys[0] == "fingerprint":  # compared whole: the difference is named by its path in it
        if keys[1:3] == ["model", "files"] and len(keys) > 3:
            return keys[3]  # "the model in DIR changed (config.json differ)"
        return path_of(keys[1:])
    if mutation in ("one fewer", "one more"):
        return f"damaged: {keys[0]}"  # a count: the list, or the entry left without its match
    if keys[0] == "engine" and len(keys) >= 4 and keys[3] == "tokens":
        return path_of(keys[:4])  # a sequence's tokens are checked whole, against its request
    if keys == ["sha256"]:
        return "sha256"
    return path


TOKEN_LISTS = ("generated", "tokens", "prompt_ids")


def mutations(value, keys, in_dict):
    """(mutation name, keys, damage, resealed) for the value at `keys` and everything under it."""
    sealed = keys != ["sha256"]
    out = []
    if in_dict:
        out.append(("missing", keys, deleter(keys), sealed))
    if keys:  # run.json not an object: a row of its own below
        out.append(("wrong type", keys, setter(keys, WRONG_TYPE[type(value)]), sealed))
    if isinstance(value, bool):
        out.append(("flipped", keys, setter(keys, not value), sealed))
    elif isinstance(value, int):
        out += [("negative", keys, setter(keys, -1), sealed), ("huge", keys, setter(keys, 2**130), sealed)]
    elif isinstance(value, float):
        out += [(f"{v}", keys, setter(keys, v), sealed) for v in (-1.0, math.nan, math.inf)]
    elif isinstance(value, str):
        out.append(("another string", keys, setter(keys, "~bad~"), sealed))
    elif isinstance(value, dict):
        out.append(("an extra key", keys + ["unexpected"], lambda d, k=keys: get(d, k).update(unexpected=1), sealed))
        for k, v in value.items():
            if keys == [] and k == "format":
                out += [(m, [k], setter([k], v2), True) for m, v2 in (("wrong type", "2"), ("another version", 1))]
                continue
            out += mutations(v, keys + [k], True)
    elif isinstance(value, list) and value:
        # The length of a token list is checked against its run by consistency or the seal (below).
        if keys[-1] not in TOKEN_LISTS:
            out += [("one fewer", keys, resizer(keys, -1), sealed), ("one more", keys, resizer(keys, +1), sealed)]
        for i in sorted({0, len(value) - 1}):
            out += mutations(value[i], keys + [i], False)
    return out


def cases(saved_dir):
    data = json.loads((saved_dir / "run.json").read_text())
    return [
        (f"{path_of(keys) or 'run.json'}: {m}", keys, m, damage, sealed)
        for m, keys, damage, sealed in mutations(data, [], False)
    ]


@pytest.mark.parametrize("layout", ["mlx:cell", "mlx:seq"])
def test_every_field_of_run_json_corrupted_every_way_is_refused_naming_it(
    tmp_path, tiny_dir, tiny_loaded, saved_states, layout
):
    table = cases(saved_states[layout])
    assert len(table) > 150  # the walk reached the whole state
    broken = []
    for case, keys, mutation, damage, sealed in table:
        d = damaged_copy(tmp_path / str(len(broken)) / case.replace("/", "_"), saved_states[layout], damage, sealed)
        try:
            refused_naming(tmp_path, tiny_dir, tiny_loaded, layout, d, expected_name(keys, mutation))
        except (Exception, pytest.fail.Exception) as exc:  # collect them all, then report every one
            broken.append(f"{case}: {type(exc).__name__}: {str(exc)[:300]}")
        finally:
            shutil.rmtree(d.parent)
    assert not broken, f"{len(broken)} of {len(table)} cases broken:\n" + "\n".join(broken)


# Edits that leave every field plausible (the count, the range, the run's consistency): only
# the seal can tell, and does.
def shorten_to_a_stop(data):
    sample = data["samples"][0][0]  # finished at max_tokens: as if an EOS had come one token earlier
    sample.update(finish_reason="stop", generated=sample["generated"][:-1])


PLAUSIBLE = {
    "a finished sample's token swapped for another": lambda d: d["samples"][0][0]["generated"].__setitem__(0, 65),
    "a finished sample's tokens shortened": shorten_to_a_stop,
    "the step count changed": lambda d: d["stats"].update(steps=d["stats"]["steps"] + 1),
    "an rng state moved on": lambda d: d["samples"][2][0]["rng"]["state"].update(state=12345),
}


@pytest.mark.parametrize("layout", ["mlx:cell", "mlx:seq"])
@pytest.mark.parametrize("damage", PLAUSIBLE.values(), ids=PLAUSIBLE.keys())
def test_an_edit_that_leaves_every_field_plausible_is_refused_by_the_seal(
    tmp_path, tiny_dir, tiny_loaded, saved_states, layout, damage
):
    d = damaged_copy(tmp_path, saved_states[layout], damage, sealed=False)
    refused_naming(tmp_path, tiny_dir, tiny_loaded, layout, d, "run.json was changed after it was saved")


# -- the issue's cases, by name -------------------------------------------------------------


def named_rows(vocab):
    return {
        "samples missing": (lambda d: d.pop("samples"), "samples: missing"),
        "a shorter request list": (lambda d: d["samples"].pop(), "samples: 3 item(s), expected 4"),
        "one request's samples missing": (lambda d: d["samples"][1].pop(), "samples[1]: 1 item(s), expected 2"),
        "garbage in rng": (lambda d: d["samples"][1][0].update(rng="garbage"), "samples[1][0].rng"),
        "rng of another generator": (
            lambda d: d["samples"][1][0]["rng"].update(bit_generator="MT19937"), "samples[1][0].rng.bit_generator"),
        "garbage in engine": (lambda d: d.update(engine={"garbage": 1}), "engine.kind: missing"),
        "engine of another kind": (lambda d: d["engine"].update(kind="paged"), "engine.kind"),
        "garbage in stats": (lambda d: d.update(stats={"nonsense": 1}), "stats."),
        "stats of a negative count": (lambda d: d["stats"].update(steps=-3), "stats.steps=-3"),
        "a token id past the vocabulary": (
            lambda d: d["samples"][1][0]["generated"].__setitem__(0, vocab), f"samples[1][0].generated[0]={vocab}"),
        "a negative token id": (
            lambda d: d["samples"][1][0]["generated"].__setitem__(0, -5), "samples[1][0].generated[0]=-5"),
        "a float token id": (
            lambda d: d["samples"][1][0]["generated"].__setitem__(0, 65.0), "samples[1][0].generated[0]=65.0"),
        "more tokens than max_tokens": (
            lambda d: d["samples"][0][0]["generated"].append(65), "samples[0][0].generated: 3 token(s)"),
        "an unknown finish reason": (
            lambda d: d["samples"][0][0].update(finish_reason="done"), "samples[0][0].finish_reason"),
        "cache_file with ..": (lambda d: d.update(cache_file="../" + d["cache_file"]), 'cache_file="../cache-'),
        "cache_file absolute": (lambda d: d.update(cache_file="/etc/passwd"), 'cache_file="/etc/passwd"'),
        "cache_file in a subdirectory": (lambda d: d.update(cache_file="sub/" + d["cache_file"]), 'cache_file="sub/'),
        "cache_file not a string": (lambda d: d.update(cache_file=None), "cache_file=null"),
        "an extra top-level key": (lambda d: d.update(note="hand-edited"), "note: not a field"),
        "run.json a list": (lambda d: Replace([d]), "expected an object, got an array"),
        "format of an older kvlayout": (
            lambda d: d.update(format=1), "run.json format 1; this kvlayout reads format 2"),
    }


ENGINE_ROWS = {
    "mlx:cell": {
        "a queue entry for request 99": (
            lambda d: d["engine"].update(queue=[{"request": 99, "samples": [0], "tokens": [1]}]),
            "engine.queue[0].request=99"),
        "a running sequence dropped": (
            lambda d: d["engine"]["running"].pop(0), "is unfinished but neither running nor queued"),
        "a running sequence twice": (
            lambda d: d["engine"]["running"].append(d["engine"]["running"][0]), "engine.running[3].samples[0]"),
        "a finished sample queued": (
            lambda d: d["engine"]["queue"][0].update(request=0, samples=[0]), "engine.queue[0].samples[0]"),
        "a sequence's tokens not its prompt": (
            lambda d: d["engine"]["running"][0]["tokens"].__setitem__(0, 66), "engine.running[0].tokens"),
        "a seq_id the cache does not hold": (
            lambda d: d["engine"]["running"][0].update(seq_id=30), "engine.running[0].cached: sequence 30 holds 0"),
        "a seq_id past the cache's ids": (
            lambda d: d["engine"]["running"][0].update(seq_id=10**6), "engine.running[0].seq_id: the cache holds no"),
        "cached past the tokens": (
            lambda d: d["engine"]["running"][0].update(cached=10**6), "engine.running[0].cached"),
        "cached short of the cache": (lambda d: d["engine"]["running"][0].update(cached=5), "engine.running[0].cached"),
        "admitted a bool": (
            lambda d: d["engine"]["running"][0].update(admitted=True), "engine.running[0].admitted=true"),
    },
    "mlx:seq": {
        "current a finished sample": (lambda d: d["engine"].update(current=[0, 0]), "engine.current"),
        "current a later sample": (lambda d: d["engine"].update(current=[2, 1]), "engine.current"),
        "current of request 99": (lambda d: d["engine"].update(current=[99, 0]), "engine.current[0]=99"),
        "cached other than the cache": (lambda d: d["engine"].update(cached=3), "engine.cached"),
        "cached with no current": (lambda d: d["engine"].update(current=None), "engine.cached="),
    },
}


def all_named_rows(vocab):
    rows = []
    for name, (damage, needle) in named_rows(vocab).items():
        rows += [(layout, name, damage, needle) for layout in STOPS]
    for layout, table in ENGINE_ROWS.items():
        rows += [(layout, name, damage, needle) for name, (damage, needle) in table.items()]
    return rows


VOCAB = 258  # the tiny preset's: 256 bytes, BOS, EOS
NAMED = all_named_rows(VOCAB)


@pytest.mark.parametrize("layout, name, damage, needle", NAMED, ids=[f"{r[0]}: {r[1]}" for r in NAMED])
def test_a_run_json_damaged_by_hand_is_refused_naming_the_field(
    tmp_path, tiny_dir, tiny_loaded, saved_states, layout, name, damage, needle
):
    assert tiny_loaded[1].vocab_size == VOCAB
    d = damaged_copy(tmp_path, saved_states[layout], damage)
    refused_naming(tmp_path, tiny_dir, tiny_loaded, layout, d, needle)


def test_an_end_of_sequence_id_kept_in_a_sample_is_refused(tmp_path, tiny_dir, tiny_loaded, saved_states):
    (eos,) = tiny_loaded[2].eos_ids
    d = damaged_copy(tmp_path, saved_states["mlx:cell"], lambda d: d["samples"][1][0]["generated"].__setitem__(0, eos))
    refused_naming(tmp_path, tiny_dir, tiny_loaded, "mlx:cell", d, f"samples[1][0].generated[0]: {eos} ends a sample")


# -- the cache file ------------------------------------------------------------------------


def cache_file(d):
    (path,) = d.glob("cache-*.safetensors")
    return path


def swap_in_other_cache(d, other, seal):
    """The cache file replaced by another run's (the other state, same name); with `seal`,
    run.json's sha256 of it and its own seal updated too, a consistent forgery."""
    target = cache_file(d)
    target.write_bytes(cache_file(other).read_bytes())
    if seal:
        data = json.loads((d / "run.json").read_text())
        data["cache_sha256"] = resume._sha256(target)
        (d / "run.json").write_text(json.dumps(reseal(data)))


CACHE_ROWS = {
    "missing": (lambda d, o: cache_file(d).unlink(), "that run.json names is not in"),
    "truncated": (lambda d, o: cache_file(d).write_bytes(cache_file(d).read_bytes()[:1000]), "its sha256 differs"),
    "a byte flipped": (
        lambda d, o: cache_file(d).write_bytes(
            cache_file(d).read_bytes()[:-5] + b"\0" + cache_file(d).read_bytes()[-4:]),
        "its sha256 differs"),
    "a directory": (
        lambda d, o: (cache_file(d).unlink(), (d / json.loads((d / "run.json").read_text())["cache_file"]).mkdir()),
        "that run.json names is not in"),
    "swapped for another run's": (lambda d, o: swap_in_other_cache(d, o, False), "its sha256 differs"),
    "swapped and run.json forged to match": (lambda d, o: swap_in_other_cache(d, o, True), "engine."),
}


@pytest.mark.parametrize("layout", ["mlx:cell", "mlx:seq"])
@pytest.mark.parametrize("damage, needle", CACHE_ROWS.values(), ids=CACHE_ROWS.keys())
def test_a_cache_file_missing_truncated_or_swapped_is_refused(
    tmp_path, tiny_dir, tiny_loaded, saved_states, tmp_path_factory, layout, damage, needle
):
    d = damaged_copy(tmp_path, saved_states[layout], lambda data: None)
    other = tmp_path_factory.mktemp("other")  # the same run, stopped two steps later
    job.prepare(run_config(tiny_dir, layout), loaded=tiny_loaded).generate(
        stop=stop_after(STOPS[layout] + 2), save_state=other
    )
    damage(d, other)
    refused_naming(tmp_path, tiny_dir, tiny_loaded, layout, d, needle)


def test_a_cache_file_of_another_layout_is_refused_by_its_layout(tmp_path, tiny_dir, tiny_loaded, saved_states):
    d = damaged_copy(tmp_path, saved_states["mlx:cell"], lambda data: None)
    swap_in_other_cache(d, saved_states["mlx:seq"], True)
    refused_naming(tmp_path, tiny_dir, tiny_loaded, "mlx:cell", d, "saved by layout mlx:seq, not mlx:cell")


RUN_JSON_ROWS = {
    "empty": (lambda p: p.write_text(""), "run.json is damaged: not JSON"),
    "not JSON": (lambda p: p.write_text("{'format': 2"), "run.json is damaged: not JSON"),
    "binary": (lambda p: p.write_bytes(b"\xff\xfe\x00garbage"), "run.json is damaged: not JSON"),
    "a directory": (lambda p: (p.unlink(), p.mkdir()), "run.json cannot be read"),
    "missing": (lambda p: p.unlink(), "no run.json there"),
}


@pytest.mark.parametrize("damage, needle", RUN_JSON_ROWS.values(), ids=RUN_JSON_ROWS.keys())
def test_a_run_json_that_cannot_be_read_is_refused(tmp_path, tiny_dir, tiny_loaded, saved_states, damage, needle):
    d = damaged_copy(tmp_path, saved_states["mlx:cell"], lambda data: None)
    damage(d / "run.json")
    refused_naming(tmp_path, tiny_dir, tiny_loaded, "mlx:cell", d, needle)


def test_the_untouched_state_resumes_to_the_uninterrupted_outputs(tiny_dir, tiny_loaded, saved_states, tmp_path):
    for layout, saved_dir in saved_states.items():
        d = damaged_copy(tmp_path / layout.replace(":", "-"), saved_dir, lambda data: None)
        resumed = job.prepare(run_config(tiny_dir, layout), loaded=tiny_loaded, resume=d).generate()
        full = job.run(run_config(tiny_dir, layout), loaded=tiny_loaded)
        assert token_ids(resumed) == token_ids(full)


# -- the real command ------------------------------------------------------------------------


def write_toml(path, tiny_dir, layout):
    backend, kind = layout.split(":")
    reqs = "".join(
        f"[[requests]]\nprompt = {json.dumps(r['prompt'])}\nmax_tokens = {r['max_tokens']}\nn = {r['n']}\n"
        for r in REQUESTS
    )
    path.write_text(
        f'[layout]\nbackend = "{backend}"\nkind = "{kind}"\n[model]\npath = "{tiny_dir}"\n'
        f'[cache]\ncapacity = 1024\nkv_dtype = "float32"\n[sampling]\ntemperature = 0.8\ntop_p = 0.9\nseed = 3\n'
        f"[engine]\nprefill_chunk = 16\n{reqs}"
    )
    return path


def kvlayout(*argv, cwd=None, timeout=120):
    env = {**os.environ, "COLUMNS": "100"}
    return subprocess.run(
        [sys.executable, "-m", "kvlayout.cli", *map(str, argv)], capture_output=True, text=True, timeout=timeout,
        env=env, cwd=cwd,
    )


def one_line_error(proc, needle, code=2):
    assert proc.returncode == code, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvlayout: error: "), proc.stderr
    assert needle in lines[0], lines[0]
    assert proc.stdout == ""  # nothing ran


# The issue's cases, and one engine row of each kind, through the command.
ISSUE = ("samples missing", "a shorter request list", "garbage in rng", "garbage in engine", "garbage in stats",
         "a token id past the vocabulary", "cache_file with ..", "run.json a list", "format of an older kvlayout",
         "a running sequence dropped", "current a later sample")
CLI_ROWS = [r for r in NAMED if r[1] in ISSUE and (r[0] == "mlx:cell" or r[1] == "current a later sample")]


@pytest.mark.parametrize("layout, name, damage, needle", CLI_ROWS, ids=[f"{r[0]}: {r[1]}" for r in CLI_ROWS])
def test_the_command_refuses_a_damaged_state_in_one_line(
    tmp_path, tiny_dir, saved_states, layout, name, damage, needle
):
    d = damaged_copy(tmp_path, saved_states[layout], damage)
    before = files(d)
    proc = kvlayout("run", write_toml(tmp_path / "run.toml", tiny_dir, layout), "--resume", d, "--save-state", d)
    one_line_error(proc, needle)
    assert files(d) == before


def test_the_command_refuses_a_model_rewritten_at_the_same_path(tmp_path, tiny_dir, saved_states):
    model = tmp_path / "model"
    shutil.copytree(tiny_dir, model)
    toml = write_toml(tmp_path / "run.toml", model, "mlx:cell")
    state = tmp_path / "state"
    # Saved by the real command, stopped by its engine's end (a state saved whole is resumable too).
    assert kvlayout("run", toml, "--json", "--save-state", state).returncode == 0
    assert kvlayout("init-model", model, "--seed", "1", "--force").returncode == 0  # same files, other weights
    before = files(state)
    proc = kvlayout("run", toml, "--resume", state)
    one_line_error(proc, f"the model in {model} changed since the state was saved (model.safetensors differs)")
    assert files(state) == before


def directory_rows(tmp_path, tiny_dir, saved_states):
    a_file = tmp_path / "a-file"
    a_file.write_text("not a directory")
    no_run = tmp_path / "empty"
    no_run.mkdir()
    run_dir = tmp_path / "run-json-a-dir"
    (run_dir / "run.json").mkdir(parents=True)
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    # Root writes through permissions: /proc is a directory no one can create a file in.
    unwritable = "/proc" if os.geteuid() == 0 else locked
    return [
        (["--resume", tmp_path / "absent"], "--resume", "no such directory"),
        (["--resume", a_file], "--resume", "not a directory"),
        (["--resume", no_run], "--resume", "no run.json there"),
        (["--resume", ""], "argument --resume", "expected a value, got an empty string"),
        (["--save-state", a_file], "--save-state", "exists and is not a directory"),
        (["--save-state", a_file / "state"], "--save-state", "cannot create the directory"),
        (["--save-state", ""], "argument --save-state", "expected a value, got an empty string"),
        (["--save-state", unwritable], "--save-state", "the directory is not writable"),
        (["--save-state", "/proc/kvlayout-state"], "--save-state", "cannot create the directory"),
        (["--save-state", run_dir], "--save-state", "run.json exists and is not a file"),
    ]


ROW_IDS = ["resume-absent", "resume-a-file", "resume-no-run-json", "resume-empty-name", "save-a-file",
           "save-under-a-file", "save-empty-name", "save-unwritable", "save-cannot-create", "save-run-json-a-dir"]


@pytest.mark.parametrize("row", range(len(ROW_IDS)), ids=ROW_IDS)
def test_the_command_refuses_a_bad_state_directory_before_running(tmp_path, tiny_dir, saved_states, row):
    argv, flag, needle = directory_rows(tmp_path, tiny_dir, saved_states)[row]
    toml = write_toml(tmp_path / "run.toml", tiny_dir, "mlx:cell")
    listing = sorted(str(p) for p in tmp_path.rglob("*"))
    proc = kvlayout("run", toml, *argv)
    one_line_error(proc, needle)
    assert flag in proc.stderr
    assert sorted(str(p) for p in tmp_path.rglob("*")) == listing  # nothing created
