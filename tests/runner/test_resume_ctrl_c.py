"""Ctrl-C at each point of `kvlayout run --save-state`, as real SIGINTs sent to this process:
before the run, before the first step, in a forward (once, twice), between forwards, while
saving (once, twice, at each write), after the save. Each row checks the exit status, the last
line on stderr (no traceback), what the directory holds, and that resuming from it gives the
uninterrupted run's outputs (the oracle) wherever it says the state was saved."""

from __future__ import annotations

import json
import signal

import pytest

from kvlayout import persist
from kvlayout.cli import main
from kvlayout.engines import cell, seq
from kvlayout.runner import job, resume
from tests.runner.flaky import with_model
from tests.runner.test_resume import SignalsAt, write_toml


class SignalsInDecode:
    """A tokenizer whose decode sends `count` SIGINTs the first time it is called once `when()`
    holds: between forwards (the runner detokenizes each kept token of a request with stop strings
    after the forward that gave it: `full`'s requests have one, never met)."""

    def __init__(self, tok, when, count: int = 1):
        self.tok, self.when, self.count, self.fired = tok, when, count, False

    def __getattr__(self, name):
        return getattr(self.tok, name)

    def decode(self, ids):
        if not self.fired and self.when():
            self.fired = True
            for _ in range(self.count):
                signal.raise_signal(signal.SIGINT)
        return self.tok.decode(ids)


def signals_at_write(monkeypatch, n: int, count: int):
    """`count` SIGINTs as the save writes its chunk `n` (1, 2: the cache file; 3: run.json)."""
    real, calls = persist._write_chunk, [0]

    def write(f, chunk):
        calls[0] += 1
        if calls[0] == n:
            for _ in range(count):
                signal.raise_signal(signal.SIGINT)
        real(f, chunk)

    monkeypatch.setattr(persist, "_write_chunk", write)


def signals_after_the_save(monkeypatch, count: int):
    """`count` SIGINTs once run.json is in place, before the save returns."""
    real = resume.write_atomic

    def write(path, chunks):
        out = real(path, chunks)
        for _ in range(count):
            signal.raise_signal(signal.SIGINT)
        return out

    monkeypatch.setattr(resume, "write_atomic", write)


@pytest.fixture
def full(tmp_path, tiny_dir, capsys):
    """The uninterrupted run's outputs, by the command itself."""
    # A stop string longer than any output (6 one-byte tokens): never met, but each kept token is
    # decoded as it comes, which is where SignalsInDecode sends Ctrl-C between forwards.
    toml = write_toml(tmp_path, tiny_dir, "mlx:cell", stop="never-met-stop-string")
    assert main(["run", str(toml), "--json"]) == 0
    return toml, [r["samples"] for r in json.loads(capsys.readouterr().out)["requests"]]


def files(d):
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())} if d.is_dir() else None


# (how Ctrl-C comes, exit status, the end of stderr's last line, what the directory then holds)
ROWS = {
    "before the first step": ("run start", 130, "stopped early; state saved to", "saved"),
    "once in a forward": ("forward 3 x1", 130, "stopped early; state saved to", "saved"),
    "twice in a forward": ("forward 3 x2", 130, "interrupted; state saved to", "saved"),
    "once in a forward, once between forwards": ("forward 3 x1, decode", 130, "stopped early; state saved to", "saved"),
    "once in a forward, twice between forwards": (
        "forward 3 x1, decode x2", 130, "interrupted; this run's state was not saved; {kept}", "previous"),
    "once while writing the cache file": ("forward 3 x1, write 1 x1", 130, "stopped early; state saved to", "saved"),
    "twice while writing the cache header": (
        "forward 3 x1, write 1 x2", 130, "interrupted; --save-state {state}: saving was abandoned (Ctrl-C); {kept}",
        "previous"),
    "twice while writing the cache data": (
        "forward 3 x1, write 2 x2", 130, "interrupted; --save-state {state}: saving was abandoned (Ctrl-C); {kept}",
        "previous"),
    "twice while writing run.json": (
        "forward 3 x1, write 3 x2", 130, "interrupted; --save-state {state}: saving was abandoned (Ctrl-C); {kept}",
        "previous"),
    "twice in a forward, then twice while saving": (
        "forward 3 x2, write 3 x2", 130, "interrupted; --save-state {state}: saving was abandoned (Ctrl-C); {kept}",
        "previous"),
    "twice as the save finishes": ("forward 3 x1, after save x2", 130, "stopped early; state saved to", "saved"),
}


def arrange(how, monkeypatch, tiny_loaded):
    """Put the SIGINTs `how` says where it says; the model the run will load is the tiny one."""
    model, tok = tiny_loaded[0], tiny_loaded[2]
    for part in how.split(", "):
        what, _, times = part.partition(" x")
        count = int(times or 1)
        if what == "run start":  # the run's handler is in place, no step taken yet
            for engine in (cell, seq):
                real = engine.run_steps
                monkeypatch.setattr(engine, "run_steps", lambda e, stop, real=real: (
                    signal.raise_signal(signal.SIGINT), real(e, stop))[1])
        elif what.startswith("forward"):
            model = SignalsAt(model, int(what.split()[1]), count)
        elif what == "decode":  # after the forward above, in the step it ends
            forwards = model
            tok = SignalsInDecode(tok, lambda: forwards.forwards >= forwards.n, count)
        elif what.startswith("write"):
            signals_at_write(monkeypatch, int(what.split()[1]), count)
        elif what == "after save":
            signals_after_the_save(monkeypatch, count)
    loaded = (model, tiny_loaded[1], tok, tiny_loaded[3])
    monkeypatch.setattr(job, "load_model_for", lambda cfg: loaded)


@pytest.mark.parametrize("resumed", [False, True], ids=["fresh", "resumed"])
@pytest.mark.parametrize("how, code, said, holds", ROWS.values(), ids=ROWS.keys())
def test_ctrl_c_at_each_point_ends_in_one_line_and_a_state_that_resumes(
    tmp_path, tiny_dir, tiny_loaded, full, capsys, monkeypatch, how, code, said, holds, resumed
):
    toml, outputs = full
    state = tmp_path / "state"
    flags = ["--json", "--save-state", str(state)]
    if resumed:  # a state saved before, which this run resumes from and saves over
        monkeypatch.setattr(job, "load_model_for", lambda cfg: with_model(tiny_loaded, SignalsAt(tiny_loaded[0], 2)))
        assert main(["run", str(toml), *flags]) == 130
        monkeypatch.undo()
        flags += ["--resume", str(state)]
    capsys.readouterr()
    before = files(state) or {}
    arrange(how, monkeypatch, tiny_loaded)

    assert main(["run", str(toml), *flags]) == code
    out, err = capsys.readouterr()
    monkeypatch.undo()
    assert "Traceback" not in err
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    kept = f"{state} keeps the state saved before" if resumed else f"nothing is saved in {state}"
    last = err.strip().splitlines()[-1]
    assert last.startswith("kvlayout: " + said.format(state=state, kept=kept)), last
    after = files(state) or {}
    if holds == "saved":
        assert after != before
        assert last.endswith(f" --resume {state} --save-state {state}")  # the command to continue
        if "stopped early" in last:  # the partial outputs came first, saying so
            partial = json.loads(out)
            assert partial["complete"] is False and partial["saved_to"] == str(state)
            assert partial["continue_with"] == last.split("continue with: ")[1]
            assert any(s["finish_reason"] == "pending" for r in partial["requests"] for s in r["samples"])
    else:
        assert after == before  # the previous state, byte for byte (no stray cache file), or nothing
    if "run.json" in after:
        assert main(["run", str(toml), "--json", "--resume", str(state)]) == 0
        assert [r["samples"] for r in json.loads(capsys.readouterr().out)["requests"]] == outputs


def test_ctrl_c_while_the_model_loads_saves_nothing_and_leaves_the_state_as_it_was(
    tmp_path, tiny_dir, tiny_loaded, full, capsys, monkeypatch
):
    toml, outputs = full
    state = tmp_path / "state"
    monkeypatch.setattr(job, "load_model_for", lambda cfg: with_model(tiny_loaded, SignalsAt(tiny_loaded[0], 2)))
    assert main(["run", str(toml), "--save-state", str(state)]) == 130
    before = files(state)

    def interrupted_load(cfg):
        signal.raise_signal(signal.SIGINT)  # before the run's handler: an ordinary KeyboardInterrupt
        return tiny_loaded

    monkeypatch.setattr(job, "load_model_for", interrupted_load)
    capsys.readouterr()
    assert main(["run", str(toml), "--resume", str(state), "--save-state", str(state)]) == 130
    assert capsys.readouterr().err == "kvlayout: interrupted\n"
    assert files(state) == before
    monkeypatch.undo()
    assert main(["run", str(toml), "--json", "--resume", str(state)]) == 0
    assert [r["samples"] for r in json.loads(capsys.readouterr().out)["requests"]] == outputs


@pytest.mark.parametrize("where", ["in a forward", "between forwards"])
def test_ctrl_c_without_save_state_is_one_line(tmp_path, tiny_dir, tiny_loaded, capsys, monkeypatch, where):
    toml = write_toml(tmp_path, tiny_dir, "mlx:seq")
    if where == "in a forward":
        loaded = with_model(tiny_loaded, SignalsAt(tiny_loaded[0], 3))
    else:
        loaded = (tiny_loaded[0], tiny_loaded[1], SignalsInDecode(tiny_loaded[2], lambda: True), tiny_loaded[3])
    monkeypatch.setattr(job, "load_model_for", lambda cfg: loaded)
    assert main(["run", str(toml)]) == 130
    out, err = capsys.readouterr()
    assert err.strip().splitlines()[-1] == "kvlayout: interrupted" and "Traceback" not in err
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
