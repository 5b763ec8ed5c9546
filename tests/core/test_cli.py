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
from tests.helpers import ROOT


@pytest.fixture
def wide(monkeypatch):
    monkeypatch.setenv("COLUMNS", "240")  # rich wraps at the terminal width


WATCHER = """
    from kvlayout import hookimpl

    @hookimpl
    def kvlayout_step_placed(step, window):
        pass

    @hookimpl(tryfirst=True)
    def kvlayout_choose_cells(free, count):
        return None
"""


@pytest.fixture
def with_watcher(plugin_world):
    """plugin_world plus a plugin with no layout: a placement policy and an observer."""
    plugin_world.add("kvlayout-fake-watch", "0.3", {"watch": "kvl_fake_watch"}, {"kvl_fake_watch": WATCHER})
    return plugin_world


def test_plugins_prints_every_plugin_its_layouts_the_duplicates_and_the_failed(with_watcher, wide, capsys):
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()

    def row(*cells):
        [line] = [line for line in lines if all(f" {c} " in line for c in cells)]
        return line

    # The plugins table: every registered plugin with the hooks it implements, layout or not.
    row("watch", "kvlayout-fake-watch", "0.3", "kvlayout_choose_cells, kvlayout_step_placed")
    row("good", "kvlayout-fake-good", "1.2.3", "kvlayout_builders")
    row("cell", "kvlayout-cell", "kvlayout_builders, kvlayout_choose_cells")
    # The layouts table; the two claims of fake:dup marked, and a line saying what that means.
    good = row("fake", "good", "kvlayout-fake-good", "1.2.3", "a layout that works")
    assert "duplicate" not in good
    assert "duplicate" in row("fake", "dup", "kvlayout-fake-dup-a", "1.0")
    assert "duplicate" in row("fake", "dup", "kvlayout-fake-dup-b", "2.0")
    [dup] = [line for line in lines if line.startswith("duplicate")]
    assert dup == ("duplicate fake:dup is claimed by kvlayout-fake-dup-a 1.0 and kvlayout-fake-dup-b 2.0: "
                   "using it fails until all but one are uninstalled")
    [failed] = [line for line in lines if line.startswith("failed")]
    assert failed == ("failed broken from kvlayout-fake-broken 0.0.1: "
                      "ImportError: kvl_fake_broken cannot find its native library")


def test_plugins_without_duplicates_has_no_note_column(fake_dists, wide, capsys):
    from tests.conftest import GOOD_PLUGIN

    fake_dists.add("kvlayout-fake-good", "1.2.3", {"good": "kvl_fake_good"}, {"kvl_fake_good": GOOD_PLUGIN})
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    assert " note " not in out and "duplicate" not in out and "failed" not in out


def test_plugins_json_lists_plugins_layouts_and_failures(with_watcher, capsys):
    assert main(["plugins", "--json"]) == 0
    payload = json.loads(capsys.readouterr().out)
    assert set(payload) == {"plugins", "layouts", "failed"}
    fake_plugins = [p for p in payload["plugins"] if p["distribution"].startswith("kvlayout-fake-")]
    assert fake_plugins == [
        {"name": "dup_a", "distribution": "kvlayout-fake-dup-a", "version": "1.0", "hooks": ["kvlayout_builders"]},
        {"name": "dup_b", "distribution": "kvlayout-fake-dup-b", "version": "2.0", "hooks": ["kvlayout_builders"]},
        {"name": "good", "distribution": "kvlayout-fake-good", "version": "1.2.3", "hooks": ["kvlayout_builders"]},
        {"name": "watch", "distribution": "kvlayout-fake-watch", "version": "0.3",
         "hooks": ["kvlayout_choose_cells", "kvlayout_step_placed"]},
    ]
    layouts = [entry for entry in payload["layouts"] if entry["backend"] == "fake"]
    assert layouts == [
        {"backend": "fake", "kind": "dup", "distribution": "kvlayout-fake-dup-a", "version": "1.0",
         "summary": "one of two claims", "duplicate": True},
        {"backend": "fake", "kind": "dup", "distribution": "kvlayout-fake-dup-b", "version": "2.0",
         "summary": "one of two claims", "duplicate": True},
        {"backend": "fake", "kind": "good", "distribution": "kvlayout-fake-good", "version": "1.2.3",
         "summary": "a layout that works", "duplicate": False},
    ]
    [failed] = [f for f in payload["failed"] if f["distribution"] == "kvlayout-fake-broken"]
    assert failed == {"entry_point": "broken", "distribution": "kvlayout-fake-broken", "version": "0.0.1",
                      "hook": None, "error": "ImportError: kvl_fake_broken cannot find its native library"}


def kvlayout_command() -> str:
    beside = Path(sys.executable).parent / "kvlayout"
    found = str(beside) if beside.exists() else shutil.which("kvlayout")
    assert found is not None, "the kvlayout command is not installed (pip install -e .)"
    return found


def test_the_installed_command_prints_json(plugin_world):
    # The fakes first, then whatever the suite runs with: the command must run the code under test,
    # not whichever checkout the console script was installed from.
    path = os.pathsep.join(filter(None, [str(plugin_world.root), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, PYTHONPATH=path)
    env.pop("KVLAYOUT_STRICT", None)
    done = subprocess.run(
        [kvlayout_command(), "plugins", "--json"], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0, done.stderr
    payload = json.loads(done.stdout)
    assert set(payload) == {"plugins", "layouts", "failed"}
    assert ("fake", "good", "kvlayout-fake-good") in {
        (e["backend"], e["kind"], e["distribution"]) for e in payload["layouts"]
    }
    assert "kvlayout-fake-broken" in {f["distribution"] for f in payload["failed"]}
    assert done.stderr == ""  # the failure is in the output; said once, not again on stderr


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


def _checkout_installs(hint: str) -> dict[str, set[str]]:
    """What `pip install -e PATH[extras] ...` in `hint` installs from this checkout: each distribution's name
    (read from PATH's pyproject.toml, which must exist) and the extras named, which it must declare."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib
    words = hint.replace("'", " ").replace('"', " ").replace(",", " ").split()
    assert words[:2] == ["pip", "install"] and "-e" in words, hint
    installs = {}
    for i, word in enumerate(words):
        if word != "-e":
            continue
        path, _, extras = words[i + 1].partition("[")
        project = tomllib.loads((ROOT / path / "pyproject.toml").read_text())["project"]
        wanted = set(filter(None, extras.rstrip("]").split(",")))
        assert wanted <= set(project.get("optional-dependencies", {})), (hint, wanted)
        installs[project["name"]] = wanted
    return installs


@pytest.fixture
def no_layouts(fake_dists, monkeypatch) -> set[str]:
    """No layout installed, as kvlayout sees it; the distributions that would give the real ones."""
    from kvlayout import registry

    real = {b.distribution for b in registry.available()}
    assert real == {"kvlayout-seq", "kvlayout-cell"}
    monkeypatch.setattr(registry, "available", lambda pm=None: [])
    return real


def test_no_layouts_installed_names_the_install_that_works_from_a_checkout(no_layouts, wide, capsys):
    layouts = no_layouts
    assert main(["plugins"]) == 0
    [line] = [line for line in capsys.readouterr().out.splitlines() if line.startswith("no layouts installed: ")]
    assert _checkout_installs(line.removeprefix("no layouts installed: ")) == {name: set() for name in layouts}
    with pytest.raises(SystemExit) as exited:
        main(["--version"])
    assert exited.value.code == 0
    [line] = [line for line in capsys.readouterr().out.splitlines() if line.startswith("layouts: ")]
    assert line.startswith("layouts: none (") and line.endswith(")")
    assert _checkout_installs(line.removeprefix("layouts: none (")[:-1]) == {name: set() for name in layouts}


def test_the_bench_extras_install_hint_works_from_a_checkout():
    from kvlayout.bench import peers

    assert _checkout_installs(peers.INSTALL) == {"kvlayout": {"bench"}}


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
