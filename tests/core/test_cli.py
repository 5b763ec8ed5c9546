"""`kvlayout plugins [--json]` lists the fake plugins and the one that failed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvlayout.cli import main


@pytest.fixture
def wide(monkeypatch):
    monkeypatch.setenv("COLUMNS", "240")  # rich wraps at the terminal width


def test_plugins_prints_a_table_of_layouts_and_the_failed_plugin(plugin_world, wide, capsys):
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    [good] = [line for line in out.splitlines() if "kvlayout-fake-good" in line]
    for cell in ("fake", "good", "1.2.3", "a layout that works"):
        assert cell in good
    assert sum("kvlayout-fake-dup-" in line for line in out.splitlines()) == 2
    [failed] = [line for line in out.splitlines() if "kvlayout-fake-broken" in line]
    assert "failed" in failed and "broken" in failed and "0.0.1" in failed
    assert "cannot find its native library" in failed


def test_plugins_json_lists_layouts_and_failures(plugin_world, capsys):
    assert main(["plugins", "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    layouts = [entry for entry in payload["layouts"] if entry["backend"] == "fake"]
    assert layouts == [
        {"backend": "fake", "kind": "dup", "distribution": "kvlayout-fake-dup-a", "version": "1.0",
         "summary": "one of two claims"},
        {"backend": "fake", "kind": "dup", "distribution": "kvlayout-fake-dup-b", "version": "2.0",
         "summary": "one of two claims"},
        {"backend": "fake", "kind": "good", "distribution": "kvlayout-fake-good", "version": "1.2.3",
         "summary": "a layout that works"},
    ]
    [failed] = [f for f in payload["failed"] if f["distribution"] == "kvlayout-fake-broken"]
    assert failed["entry_point"] == "broken" and failed["version"] == "0.0.1"
    assert "ImportError" in failed["error"] and "cannot find its native library" in failed["error"]


def kvlayout_command() -> str:
    beside = Path(sys.executable).parent / "kvlayout"
    found = str(beside) if beside.exists() else shutil.which("kvlayout")
    assert found is not None, "the kvlayout command is not installed (pip install -e .)"
    return found


def test_the_installed_command_prints_json(plugin_world):
    env = dict(os.environ, PYTHONPATH=str(plugin_world.root))
    env.pop("KVLAYOUT_STRICT", None)
    done = subprocess.run(
        [kvlayout_command(), "plugins", "--json"], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr
    payload = json.loads(done.stdout)
    assert set(payload) == {"layouts", "failed"}
    assert ("fake", "good", "kvlayout-fake-good") in {
        (e["backend"], e["kind"], e["distribution"]) for e in payload["layouts"]
    }
    assert "kvlayout-fake-broken" in {f["distribution"] for f in payload["failed"]}
    assert "kvlayout-fake-broken" in done.stderr  # also reported on stderr


@pytest.mark.parametrize(
    "argv",
    [
        ["run", "--model", "{tiny}", "--prompt", "hi", "--raw", "--max-tokens", "3"],  # the table, through rich
        ["run", "--model", "{tiny}", "--prompt", "hi", "--raw", "--max-tokens", "3", "--json"],
        ["plugins"],
        ["plugins", "--json"],
        ["init-model", "{tmp}/m"],
        ["--help"],
        ["run", "--help"],
        ["--version"],
        ["run", "--print-config"],
    ],
    ids=" ".join,
)
def test_a_reader_that_goes_away_ends_every_command_with_141_quietly(tiny_dir, tmp_path, argv):
    from tests.helpers import cli_env

    argv = [a.replace("{tiny}", str(tiny_dir)).replace("{tmp}", str(tmp_path)) for a in argv]
    # The reader closes before the command writes (as `| head -1` does once it has its line).
    proc = subprocess.Popen([sys.executable, "-m", "kvlayout.cli", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=cli_env())
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141, err  # as a shell reports a writer killed by SIGPIPE
    assert "Traceback" not in err and "BrokenPipeError" not in err and "Exception ignored" not in err


@pytest.mark.parametrize("value, strict", [("1", True), ("true", True), ("Yes", True), ("on", True),
                                           ("0", False), ("false", False), ("No", False), ("off", False), ("", False)])
def test_kvlayout_strict_reads_yes_and_no_words(plugin_world, monkeypatch, capsys, value, strict):
    monkeypatch.setenv("KVLAYOUT_STRICT", value)
    if strict:  # the broken plugin stops the command
        assert main(["plugins", "--json"]) == 2
        assert "failed to load" in capsys.readouterr().err
    else:  # it is listed and skipped
        assert main(["plugins", "--json"]) == 0
        assert "kvlayout-fake-broken" in {f["distribution"] for f in json.loads(capsys.readouterr().out)["failed"]}


def test_version_names_kvlayout_mlx_python_and_each_installed_layout(plugin_world, capsys):
    import importlib.metadata
    import platform

    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    first, layouts = capsys.readouterr().out.splitlines()
    assert first == (f"kvlayout {importlib.metadata.version('kvlayout')} "
                     f"(mlx {importlib.metadata.version('mlx')}, Python {platform.python_version()})")
    assert layouts.startswith("layouts: ")
    for entry in ("fake:good (kvlayout-fake-good 1.2.3)", "fake:dup (kvlayout-fake-dup-a 1.0)",
                  "fake:dup (kvlayout-fake-dup-b 2.0)", "mlx:seq (kvlayout-seq ", "mlx:cell (kvlayout-cell "):
        assert entry in layouts


def test_ctrl_c_where_no_command_catches_it_is_one_line_and_exit_130(fake_dists):
    import signal

    from tests.helpers import CLI_PATH, cli_env

    fake_dists.add("kvlayout-fake-slow", "1.0", {"slow": "kvl_fake_slow"}, {"kvl_fake_slow": """
        import sys, time
        print("loading", file=sys.stderr, flush=True)
        time.sleep(60)
    """})
    env = cli_env(PYTHONPATH=os.pathsep.join([str(fake_dists.root), CLI_PATH]))
    proc = subprocess.Popen([sys.executable, "-m", "kvlayout.cli", "plugins"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    assert proc.stderr.readline() == "loading\n"  # inside main, loading the plugins
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert (proc.returncode, out, err) == (130, "", "kvlayout: interrupted\n")
