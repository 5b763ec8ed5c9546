"""`--save-state` / `--resume`: a run stopped after k steps and resumed gives the uninterrupted outputs."""

from __future__ import annotations

import errno
import json
import re
import shutil
import signal
from pathlib import Path

import attrs
import pytest

from kvlayout import StateError, persist
from kvlayout.cli import main
from kvlayout.errors import Interrupted, SaveFailed
from kvlayout.models import presets
from kvlayout.runner import job, resume
from kvlayout.runner.config import ModelSection
from kvlayout.runner.interrupt import StopOnCtrlC
from tests.runner.conftest import QUESTIONS, SYSTEM, make_config, token_ids
from tests.runner.flaky import FlakyModel, with_model
from tests.runner.test_step_rule import three_installed  # noqa: F401 - a fixture

LAYOUTS = ["mlx:cell", "mlx:seq"]


def requests(max_tokens=8):
    return [{"prompt": SYSTEM + q, "max_tokens": max_tokens, "n": 2} for q in QUESTIONS]


def config(tiny_dir, layout, temperature=0.0, **kw):
    return make_config(
        tiny_dir, layout, requests=requests(**kw), sampling={"temperature": temperature, "top_p": 0.9, "seed": 3},
        engine={"prefill_chunk": 16},
    )


_full: dict = {}


def uninterrupted(tiny_dir, tiny_loaded, layout, temperature):
    key = (layout, temperature)
    if key not in _full:
        _full[key] = job.run(config(tiny_dir, layout, temperature), loaded=tiny_loaded)
    return _full[key]


def stop_after(k):
    """A stop() that lets k steps run."""
    calls = 0

    def stop():
        nonlocal calls
        calls += 1
        return calls > k

    return stop


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("k, temperature", [(2, 0.0), (11, 0.0), (18, 0.0), (11, 0.8)])
def test_a_run_stopped_after_k_steps_and_resumed_gives_the_uninterrupted_outputs(
    tmp_path, tiny_dir, tiny_loaded, layout, k, temperature
):
    cfg = config(tiny_dir, layout, temperature)
    first = job.prepare(cfg, loaded=tiny_loaded).generate(stop=stop_after(k), save_state=tmp_path)
    assert not first.complete
    assert any(s.finish_reason == "pending" for samples in first.outputs for s in samples)
    resumed = job.prepare(cfg, loaded=tiny_loaded, resume=tmp_path).generate()
    assert resumed.complete
    full = uninterrupted(tiny_dir, tiny_loaded, layout, temperature)
    assert token_ids(resumed) == token_ids(full)
    assert [[s.finish_reason for s in r] for r in resumed.outputs] == [
        [s.finish_reason for s in r] for r in full.outputs
    ]
    assert resumed.stats.steps == full.stats.steps  # the saved statistics carry on


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_run_stopped_twice_resumes_from_the_latest_state(tmp_path, tiny_dir, tiny_loaded, layout):
    cfg = config(tiny_dir, layout)
    job.prepare(cfg, loaded=tiny_loaded).generate(stop=stop_after(5), save_state=tmp_path)
    job.prepare(cfg, loaded=tiny_loaded, resume=tmp_path).generate(stop=stop_after(9), save_state=tmp_path)
    assert len(list(tmp_path.glob("cache-*.safetensors"))) == 1  # the older cache file is gone
    resumed = job.prepare(cfg, loaded=tiny_loaded, resume=tmp_path).generate()
    assert token_ids(resumed) == token_ids(uninterrupted(tiny_dir, tiny_loaded, layout, 0.0))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("k", [1, None])  # in layer 1 of 2, or after both (the LM head)
def test_ctrl_c_inside_a_forward_aborts_the_step_saves_and_resumes_exactly(tmp_path, tiny_dir, tiny_loaded, layout, k):
    cfg = config(tiny_dir, layout)
    flaky = FlakyModel(tiny_loaded[0], k, fail_calls=[14], exc=KeyboardInterrupt)
    prepared = job.prepare(cfg, loaded=with_model(tiny_loaded, flaky))
    with pytest.raises(Interrupted):
        prepared.generate(save_state=tmp_path)
    assert flaky.layer.raised == 1
    resumed = job.prepare(cfg, loaded=tiny_loaded, resume=tmp_path).generate()
    assert token_ids(resumed) == token_ids(uninterrupted(tiny_dir, tiny_loaded, layout, 0.0))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_finished_run_saved_at_the_end_resumes_to_the_same_outputs(tmp_path, tiny_dir, tiny_loaded, layout):
    cfg = config(tiny_dir, layout)
    done = job.prepare(cfg, loaded=tiny_loaded).generate(save_state=tmp_path)
    assert done.complete and json.loads((tmp_path / "run.json").read_text())["complete"] is True
    again = job.prepare(cfg, loaded=tiny_loaded, resume=tmp_path).generate()
    assert token_ids(again) == token_ids(done)
    assert again.stats.steps == done.stats.steps  # nothing left to run


def variant(tiny_dir, layout="mlx:cell", model=None, request=None, **sections):
    """The config of `config(tiny_dir, "mlx:cell")` with one thing changed."""
    reqs = [{**r, **(request or {})} for r in requests()]
    base = {"sampling": {"temperature": 0.0, "top_p": 0.9, "seed": 3}, "engine": {"prefill_chunk": 16}}
    for name, values in sections.items():
        base[name] = {**base.get(name, {}), **values}
    cfg = make_config(tiny_dir, layout, requests=reqs, **base)
    return cfg if model is None else attrs.evolve(cfg, model=ModelSection(**model))


# Each a run config that differs from the saved one in one way, and what the refusal names.
CHANGED = {
    "max_tokens": (dict(request={"max_tokens": 9}), "requests[0].max_tokens (saved 8, now 9)"),
    "n": (dict(request={"n": 3}), "requests[0].n (saved 2, now 3)"),
    "a prompt": (dict(request={"prompt": "another prompt"}), "requests[0].prompt_ids"),
    "stop strings": (dict(request={"stop": ["\n"]}), "requests[0].stop"),
    "temperature": (dict(sampling={"temperature": 0.5}), "sampling.temperature (saved 0.0, now 0.5)"),
    "top_p": (dict(sampling={"top_p": 0.5}), "sampling.top_p"),
    "sampling seed": (dict(sampling={"seed": 4}), "sampling.seed (saved 3, now 4)"),
    "prefill_chunk": (dict(engine={"prefill_chunk": 8}), "engine.prefill_chunk"),
    "capacity": (dict(cache={"capacity": 2048}), "cache.capacity (saved 1024, now 2048)"),
    "max_seqs": (dict(cache={"max_seqs": 8}), "cache.max_seqs"),
    "kv_dtype": (dict(cache={"kv_dtype": "float16"}), 'kv_dtype (saved "float32", now "float16")'),
    "layout": (dict(layout="mlx:seq"), 'layout (saved "mlx:cell", now "mlx:seq")'),
    "model dtype": (dict(model={"path": "TINY", "dtype": "float16"}), 'model.dtype (saved "auto", now "float16")'),
    "a preset for the directory": (dict(model={"preset": "tiny"}), "model.path"),
}


@pytest.mark.parametrize("change, needle", CHANGED.values(), ids=CHANGED.keys())
def test_resuming_with_another_config_layout_or_dtype_is_refused_naming_what_differs(
    tmp_path, tiny_dir, tiny_loaded, change, needle
):
    state = tmp_path / "state"
    job.prepare(variant(tiny_dir), loaded=tiny_loaded).generate(stop=stop_after(3), save_state=state)
    if "model" in change and change["model"].get("path") == "TINY":
        change = {**change, "model": {**change["model"], "path": str(tiny_dir)}}
    before = {p.name: p.read_bytes() for p in state.iterdir()}
    with pytest.raises(StateError, match=re.escape(needle)) as info:
        job.prepare(variant(tiny_dir, **change), loaded=tiny_loaded, resume=state)
    assert "saved by a run with another config" in str(info.value)
    assert {p.name: p.read_bytes() for p in state.iterdir()} == before


def rewrite_tiny(d, **kw):
    from kvlayout.models.presets import write_preset

    write_preset(d, "tiny", force=True, **kw)


# Each changes the model directory in place (the path the config names stays the same).
MODEL_CHANGES = {
    "init-model rewrote it with another seed": (lambda d: rewrite_tiny(d, seed=1), "model.safetensors differs"),
    "config.json edited": (
        lambda d: (d / "config.json").write_text((d / "config.json").read_text().replace("{", '{"note": 1, ', 1)),
        "config.json differs"),
    "a tokenizer.json added": (lambda d: (d / "tokenizer.json").write_text("{}"), "tokenizer.json differs"),
    "generation_config.json added": (
        lambda d: (d / "generation_config.json").write_text('{"eos_token_id": 10}'), "generation_config.json differs"),
    "a chat template added": (
        lambda d: (d / "chat_template.jinja").write_text("{{ messages }}"), "chat_template.jinja"),
    "a second weights shard": (
        lambda d: shutil.copy(d / "model.safetensors", d / "model-2.safetensors"), "model-2.safetensors differs"),
    "the weights removed and put back renamed": (
        lambda d: (d / "model.safetensors").rename(d / "weights.safetensors"),
        "model.safetensors, weights.safetensors differ"),
}


@pytest.mark.parametrize("change, needle", MODEL_CHANGES.values(), ids=MODEL_CHANGES.keys())
def test_resuming_after_the_model_changed_at_the_same_path_is_refused_naming_the_file(
    tmp_path, tiny_dir, tiny_loaded, change, needle
):
    model = tmp_path / "model"
    shutil.copytree(tiny_dir, model)
    cfg = variant(model)
    state = tmp_path / "state"
    job.prepare(cfg, loaded=tiny_loaded).generate(stop=stop_after(3), save_state=state)
    change(model)
    with pytest.raises(StateError, match=re.escape(f"the model in {model} changed since the state was saved")) as info:
        job.prepare(cfg, loaded=tiny_loaded, resume=state)
    assert needle in str(info.value)


def test_the_same_model_files_written_again_still_resume(tmp_path, tiny_dir, tiny_loaded):
    model = tmp_path / "model"
    shutil.copytree(tiny_dir, model)
    cfg = variant(model)
    state = tmp_path / "state"
    job.prepare(cfg, loaded=tiny_loaded).generate(stop=stop_after(5), save_state=state)
    rewrite_tiny(model)  # the same seed: the same bytes, a new mtime
    resumed = job.prepare(cfg, loaded=tiny_loaded, resume=state).generate()
    assert token_ids(resumed) == token_ids(job.run(cfg, loaded=tiny_loaded))


def test_a_preset_is_known_by_its_name_and_seed(tmp_path, tiny_loaded):
    from kvlayout.models.presets import build_preset

    cfg = lambda seed: variant(Path("unused"), model={"preset": "tiny", "seed": seed})  # noqa: E731
    loaded = (*build_preset("tiny", seed=0), "preset:tiny")
    state = tmp_path / "state"
    job.prepare(cfg(0), loaded=loaded).generate(stop=stop_after(3), save_state=state)
    assert json.loads((state / "run.json").read_text())["fingerprint"]["model"]["files"] is None
    with pytest.raises(StateError, match=re.escape("model.seed (saved 0, now 1)")):
        job.prepare(cfg(1), loaded=loaded, resume=state)


def test_the_smollm2_preset_is_known_by_its_files(tmp_path, tiny_dir, tiny_loaded, monkeypatch):
    fetched = tmp_path / "smollm2"  # stands in for the converted SmolLM2 directory
    shutil.copytree(tiny_dir, fetched)
    monkeypatch.setitem(presets.FETCHED, "smollm2", lambda: fetched)
    cfg = variant(Path("unused"), model={"preset": "smollm2"})
    state = tmp_path / "state"
    job.prepare(cfg, loaded=tiny_loaded).generate(stop=stop_after(3), save_state=state)
    rewrite_tiny(fetched, seed=2)
    message = "the model of preset 'smollm2' changed since the state was saved (model.safetensors differs)"
    with pytest.raises(StateError, match=re.escape(message)):
        job.prepare(cfg, loaded=tiny_loaded, resume=state)


def test_a_damaged_or_missing_state_is_refused(tmp_path, tiny_dir, tiny_loaded):
    cfg = config(tiny_dir, "mlx:cell")
    with pytest.raises(StateError, match="no run.json there"):
        job.prepare(cfg, loaded=tiny_loaded, resume=tmp_path)
    job.prepare(cfg, loaded=tiny_loaded).generate(stop=stop_after(3), save_state=tmp_path)
    (cache_file,) = tmp_path.glob("cache-*.safetensors")
    data = bytearray(cache_file.read_bytes())
    data[-5] ^= 0x40
    cache_file.write_bytes(bytes(data))
    with pytest.raises(StateError, match="is not the one run.json names"):
        job.prepare(cfg, loaded=tiny_loaded, resume=tmp_path)


def test_a_save_that_fails_keeps_the_previous_state_and_the_run_s_outputs(tmp_path, tiny_dir, tiny_loaded, monkeypatch):
    cfg = config(tiny_dir, "mlx:seq")
    job.prepare(cfg, loaded=tiny_loaded).generate(stop=stop_after(4), save_state=tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}

    def disk_full(f, chunk):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(persist, "_write_chunk", disk_full)  # every file the save writes
    result = job.prepare(cfg, loaded=tiny_loaded, resume=tmp_path).generate(save_state=tmp_path)
    monkeypatch.undo()
    assert result.complete  # the run itself is whole, and returned
    full = uninterrupted(tiny_dir, tiny_loaded, "mlx:seq", 0.0)
    assert token_ids(result) == token_ids(full)
    assert isinstance(result.save_failed, SaveFailed)
    message = str(result.save_failed)
    assert message.startswith(f"--save-state {tmp_path}: the state was not saved: ")
    assert "No space left on device" in message
    assert message.endswith(f"; {tmp_path} keeps the state saved before")
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # no stray file either
    resumed = job.prepare(cfg, loaded=tiny_loaded, resume=tmp_path).generate()
    assert token_ids(resumed) == token_ids(full)


def test_a_save_that_fails_with_no_state_before_says_nothing_is_saved(tmp_path, tiny_dir, tiny_loaded, monkeypatch):
    cfg = config(tiny_dir, "mlx:cell")
    prepared = job.prepare(cfg, loaded=tiny_loaded)
    state = tmp_path / "state"
    resume.ready_to_save(state, prepared)

    def run_json_fails(path, chunks):  # the cache file is written (by persist), run.json is not
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(resume, "write_atomic", run_json_fails)
    result = prepared.generate(stop=stop_after(4), save_state=state)
    assert not result.complete and result.outputs  # the outputs so far are all there
    assert str(result.save_failed) == (
        f"--save-state {state}: the state was not saved: Input/output error; nothing is saved in {state}"
    )
    assert list(state.iterdir()) == []  # the cache file written first is gone with it


# -- the command line -------------------------------------------------------------------


def write_toml(tmp_path, tiny_dir, layout, stop: str | None = None):
    """A run of QUESTIONS on the tiny model through `layout`; `stop`: each request's stop string."""
    backend, kind = layout.split(":")
    path = tmp_path / "run.toml"
    stops = "" if stop is None else f"stop = [{json.dumps(stop)}]\n"
    reqs = "".join(
        f"[[requests]]\nprompt = {json.dumps(SYSTEM + q)}\nmax_tokens = 6\nn = 2\n{stops}" for q in QUESTIONS
    )
    path.write_text(
        f'[layout]\nbackend = "{backend}"\nkind = "{kind}"\n[model]\npath = "{tiny_dir}"\n'
        f'[cache]\ncapacity = 1024\nkv_dtype = "float32"\n[sampling]\ntemperature = 0.0\n'
        f"[engine]\nprefill_chunk = 64\n{reqs}"  # the prompts span several steps: a stop can fall among them
    )
    return path


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_cli_stopped_by_ctrl_c_saves_and_resume_finishes_the_run(tmp_path, tiny_dir, layout, capsys, monkeypatch):
    toml = write_toml(tmp_path, tiny_dir, layout)
    assert main(["run", str(toml), "--json"]) == 0
    full = json.loads(capsys.readouterr().out)

    stop = stop_after(6)
    monkeypatch.setattr(StopOnCtrlC, "__call__", lambda self: stop())  # as if Ctrl-C came at step 7
    state = tmp_path / "state"
    assert main(["run", str(toml), "--json", "--save-state", str(state)]) == 130
    err = capsys.readouterr().err
    assert err.endswith(
        f"kvlayout: stopped early; state saved to {state}; continue with: "
        f"kvlayout run {toml} --json --resume {state} --save-state {state}\n"
    )
    monkeypatch.undo()

    assert main(["run", str(toml), "--json", "--resume", str(state)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["samples"] for r in out["requests"]] == [r["samples"] for r in full["requests"]]


def test_the_cli_refuses_a_resume_from_another_config_in_one_line(tmp_path, tiny_dir, capsys):
    toml = write_toml(tmp_path, tiny_dir, "mlx:cell")
    assert main(["run", str(toml), "--json", "--save-state", str(tmp_path / "s")]) == 0
    capsys.readouterr()
    assert main(["run", str(toml), "--layout", "mlx:seq", "--resume", str(tmp_path / "s")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvlayout: error: --resume") and "differs in: layout" in err and "Traceback" not in err


def test_the_cli_refuses_a_save_state_it_cannot_write_before_running(tmp_path, tiny_dir, capsys):
    toml = write_toml(tmp_path, tiny_dir, "mlx:cell")
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    assert main(["run", str(toml), "--json", "--save-state", str(blocker / "state")]) == 2
    out, err = capsys.readouterr()
    assert out == ""  # nothing ran
    assert err.startswith(f"kvlayout: error: --save-state {blocker / 'state'}: cannot create the directory")
    assert err.count("\n") == 1


class SignalsAt:
    """A model that sends this process `count` real SIGINTs during forward `n` (as a user's Ctrl-C)."""

    def __init__(self, model, n: int, count: int = 1):
        self.model, self.n, self.count, self.forwards = model, n, count, 0

    def __getattr__(self, name):
        return getattr(self.model, name)

    def __call__(self, *args, **kw):
        self.forwards += 1
        if self.forwards == self.n:
            for _ in range(self.count):
                signal.raise_signal(signal.SIGINT)
        return self.model(*args, **kw)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_real_ctrl_c_stops_the_cli_after_the_step_and_the_state_resumes(
    tmp_path, tiny_dir, tiny_loaded, layout, capsys, monkeypatch
):
    toml = write_toml(tmp_path, tiny_dir, layout)
    assert main(["run", str(toml), "--json"]) == 0
    full = json.loads(capsys.readouterr().out)

    model = SignalsAt(tiny_loaded[0], 3)
    monkeypatch.setattr(job, "load_model_for", lambda cfg: with_model(tiny_loaded, model))
    state = tmp_path / "state"
    assert main(["run", str(toml), "--json", "--save-state", str(state)]) == 130
    assert "stopping after this step" in capsys.readouterr().err
    assert model.forwards == 3  # the step that saw the Ctrl-C finished, and no other ran
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    monkeypatch.undo()

    assert main(["run", str(toml), "--json", "--resume", str(state)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["samples"] for r in out["requests"]] == [r["samples"] for r in full["requests"]]


def test_a_save_state_that_stops_being_a_directory_mid_run_keeps_the_report(
    tmp_path, tiny_dir, tiny_loaded, capsys, monkeypatch
):
    toml = write_toml(tmp_path, tiny_dir, "mlx:cell")
    assert main(["run", str(toml), "--json"]) == 0
    outputs = [r["samples"] for r in json.loads(capsys.readouterr().out)["requests"]]
    state = tmp_path / "state"

    class DirectoryGoesAway:
        """At forward 4 the save directory becomes a file (as if replaced under the run)."""

        def __init__(self, model):
            self.model, self.forwards = model, 0

        def __getattr__(self, name):
            return getattr(self.model, name)

        def __call__(self, *a, **kw):
            self.forwards += 1
            if self.forwards == 4:
                shutil.rmtree(state)
                state.write_text("in the way")
            return self.model(*a, **kw)

    monkeypatch.setattr(job, "load_model_for", lambda cfg: with_model(tiny_loaded, DirectoryGoesAway(tiny_loaded[0])))
    assert main(["run", str(toml), "--json", "--save-state", str(state)]) == 2
    out, err = capsys.readouterr()
    result = json.loads(out)  # the whole report, printed before the error
    assert result["complete"] is True and [r["samples"] for r in result["requests"]] == outputs
    assert result["saved_to"] is None and "the state was not saved" in result["save_error"]
    (line,) = err.strip().splitlines()
    assert line.startswith(f"kvlayout: error: --save-state {state}: the state was not saved: ")
    assert line.endswith(f"; nothing is saved in {state}")


@pytest.mark.usefixtures("three_installed")
def test_save_state_with_a_layout_that_cannot_save_is_refused_before_running(tmp_path, tiny_dir, capsys):
    toml = write_toml(tmp_path, tiny_dir, "mlx:cell")
    assert main(["run", str(toml), "--layout", "test:three", "--save-state", str(tmp_path / "state")]) == 2
    out, err = capsys.readouterr()
    assert out == ""  # nothing ran
    assert err == "kvlayout: error: layout test:three cannot save its cache; --save-state needs one that can\n"
