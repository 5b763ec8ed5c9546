"""The command a stopped run prints to continue works: run for real, it finishes the run with the
uninterrupted run's outputs, whatever flags shaped the first one's config.

Each row stops a run with a real SIGINT in its third forward (in this process), takes the
"continue with:" command from its last line on stderr, runs it through a shell in a fresh
process, and compares what it prints (or, without --json, what it saved) with the outputs of
the same run left alone.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import kvlayout
import kvlayout_cell
import kvlayout_seq
from kvlayout.cli import NOT_REPLAYED_FLAGS, REPLAYED_FLAGS, main, make_parser
from kvlayout.errors import ConfigError
from kvlayout.models.presets import build_preset
from kvlayout.runner import job
from tests.runner.flaky import with_model
from tests.runner.test_resume import SignalsAt, write_toml

# This checkout's packages, for a process started in another directory.
SOURCES = os.pathsep.join(
    str(Path(m.__file__).resolve().parents[1]) for m in (kvlayout, kvlayout_seq, kvlayout_cell)
)
SHELL_PROMPT = "it's a \"test\" of $HOME; `quoting` & more\nsecond line"


def rows(tmp_path, tiny_dir):
    """(argv, stdin) for each way of starting a run; paths relative to tmp_path, the cwd."""
    shutil.copytree(tiny_dir, tmp_path / "model")
    write_toml(tmp_path, "model", "mlx:cell")  # run.toml: requests on the model in ./model, mlx:cell
    (tmp_path / "other.toml").write_text(
        (tmp_path / "run.toml").read_text().replace('path = "model"', 'path = "does/not/exist"')
    )
    return {
        "a config and --layout": (["run.toml", "--layout", "mlx:seq", "--json"], None),
        "a config and --model": (["other.toml", "--model", "model", "--json"], None),
        "--prompt with every flag": (
            ["--model", "model", "--prompt", "Hello there", "--max-tokens", "12", "--temperature", "0.8", "--raw",
             "--json"], None),
        "--prompt a shell would mangle": (
            ["--model", "model", "--prompt", SHELL_PROMPT, "--max-tokens", "9", "--json"], None),
        "--prompt from standard input, no --json": (["--model", "model", "--prompt", "-", "--max-tokens", "10"],
                                                     "Tell me a story about a cat\n"),
        "the default config": (["--json"], None),
    }


ROW_IDS = ["config-layout", "config-model", "prompt-flags", "prompt-quoting", "prompt-stdin", "default"]


def tiny_preset_when_smollm2_fails(tiny_loaded, model=None):
    """load_model_for as it goes where SmolLM2 cannot be had: the default config falls back to tiny."""
    preset = (*build_preset("tiny", seed=0), "preset:tiny")

    def load(cfg):
        if cfg.model.preset == "smollm2":
            raise ConfigError("no network here")
        base = preset if cfg.model.preset == "tiny" else (*tiny_loaded[:3], str(cfg.model_dir()))
        return base if model is None else with_model(base, model(base[0]))

    return load


def in_process(argv, stdin, monkeypatch, capsys, loader):
    monkeypatch.setattr(job, "load_model_for", loader)
    if stdin is not None:
        monkeypatch.setattr(sys, "stdin", __import__("io").StringIO(stdin))
    code = main(["run", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def samples_of(out):
    return [[s["token_ids"] for s in r["samples"]] for r in json.loads(out)["requests"]]


@pytest.mark.parametrize("row", ROW_IDS)
def test_the_printed_command_continues_the_run_to_the_uninterrupted_outputs(
    tmp_path, tiny_dir, tiny_loaded, monkeypatch, capsys, row
):
    argv, stdin = list(rows(tmp_path, tiny_dir).values())[ROW_IDS.index(row)]
    monkeypatch.chdir(tmp_path)
    # Where a process cannot have SmolLM2 (an empty kvlayout cache, pip offline), as the subprocess below.
    monkeypatch.setenv("KVLAYOUT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    json_argv = argv if "--json" in argv else [*argv, "--json"]
    code, out, _ = in_process(json_argv, stdin, monkeypatch, capsys, tiny_preset_when_smollm2_fails(tiny_loaded))
    assert code == 0
    full = samples_of(out)

    stopped = in_process([*argv, "--save-state", "state"], stdin, monkeypatch, capsys,
                         tiny_preset_when_smollm2_fails(tiny_loaded, lambda m: SignalsAt(m, 3)))
    monkeypatch.undo()
    assert stopped[0] == 130, stopped[2]
    last = stopped[2].strip().splitlines()[-1]  # the command is on one line, whatever the prompt holds
    assert last.startswith("kvlayout: stopped early; state saved to state; continue with: kvlayout run ")
    command = last.split("continue with: ", 1)[1]

    env = {**os.environ, "KVLAYOUT_CACHE": str(tmp_path / "cache"), "PIP_NO_INDEX": "1", "PYTHONPATH": SOURCES}
    shell = f'kvlayout() {{ "{sys.executable}" -m kvlayout.cli "$@"; }}\n{command}'
    done = subprocess.run(["bash", "-c", shell], capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env,
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    saved = json.loads((tmp_path / "state" / "run.json").read_text())
    assert saved["complete"] is True
    assert [[s["generated"] for s in r] for r in saved["samples"]] == full
    if "--json" in argv:
        assert samples_of(done.stdout) == full


def test_every_run_flag_is_either_replayed_or_the_continue_command_s_own(capsys):
    with pytest.raises(SystemExit):
        make_parser().parse_args(["run", "--help"])
    flags = set(re.findall(r"(?<![\w-])(--[a-z][a-z-]*)", capsys.readouterr().out)) - {"--help"}
    replayed = {"--" + dest.replace("_", "-") for dest in REPLAYED_FLAGS}
    others = {"--" + dest.replace("_", "-") for dest in NOT_REPLAYED_FLAGS}
    assert not replayed & others
    assert flags == replayed | others, "a new run flag: add it to cli.REPLAYED_FLAGS or NOT_REPLAYED_FLAGS"


def test_the_command_quotes_what_a_shell_would_split():
    from kvlayout.cli import continue_command

    args = make_parser().parse_args(["run", "my run.toml", "--layout", "mlx:seq", "--json", "--save-state", "st ate"])
    command = continue_command(args, None, "st ate")
    assert shlex.split(command) == [
        "kvlayout", "run", "my run.toml", "--layout", "mlx:seq", "--json", "--resume", "st ate",
        "--save-state", "st ate",
    ]
