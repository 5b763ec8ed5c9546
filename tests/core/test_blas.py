"""The BLAS a command multiplies with (kvlayout.runner.blas): a fast OpenBLAS by default on Linux, chosen
without a flag, each candidate checked once in a child process; `--blas none` / `KVLAYOUT_BLAS=none` and
`--blas PATH`; a library that fails its check named in one line and not used; the same tokens with the
OpenBLAS as with the reference BLAS MLX's CPU wheel bundles.

The system OpenBLAS comes from Debian (`apt-get install libopenblas0-pthread`; `.ci/run` installs it where
it is missing) and the package index's from `ngsolve-openblas` (a dependency on x86_64 Linux). On Linux
without them these tests fail saying so; they never skip there.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvlayout.errors import ConfigError
from kvlayout.runner import blas
from tests.helpers import cli_env, kvlayout, refused_in_one_line

LINUX = sys.platform.startswith("linux")
linux_only = pytest.mark.skipif(not LINUX, reason="LD_PRELOAD and MLX's bundled BLAS are Linux's")

TINY_RUN = (
    '[layout]\nbackend = "mlx"\nkind = "cell"\n[cache]\ncapacity = 512\n[model]\npreset = "tiny"\n'
    '[sampling]\ntemperature = 0.0\n'
    '[[requests]]\nprompt = "The cells of a cache, shared by forks"\nmax_tokens = 24\nn = 2\n'
    '[[requests]]\nprompt = "and a second prompt of another length"\nmax_tokens = 24\n'
)


def openblas() -> str:
    if not Path(blas.DEBIAN_OPENBLAS).is_file():
        pytest.fail(
            f"no system OpenBLAS at {blas.DEBIAN_OPENBLAS}: run `apt-get install libopenblas0-pthread`", pytrace=False
        )
    return blas.DEBIAN_OPENBLAS


def packaged() -> str:
    path = blas.package_openblas()
    if path is None:
        pytest.fail("no ngsolve-openblas installed: pip install -e . installs it on x86_64 Linux", pytrace=False)
    return path


def blas_of(env: dict) -> str:
    code = ("import mlx.core as mx; a = mx.ones((8, 8)); mx.eval(a @ a); "
            "from kvlayout.runner.blas import in_use; print(in_use())")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def run_json(tmp_path: Path, *flags: str, **env: str) -> dict:
    config = tmp_path / "run.toml"
    config.write_text(TINY_RUN)
    done = kvlayout("run", str(config), "--json", *flags, env=cli_env(**env))
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def tokens(result: dict) -> list:
    return [[s["token_ids"] for s in r["samples"]] for r in result["requests"]]


@pytest.fixture
def fresh_verdicts(tmp_path, monkeypatch):
    """A kvlayout cache of the test's own: every library is checked anew."""
    monkeypatch.setenv("KVLAYOUT_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@linux_only
def test_a_process_names_the_blas_it_multiplies_with():
    assert blas_of(cli_env()).startswith("reference BLAS bundled with mlx[cpu]")
    lib = openblas()
    assert blas_of(cli_env(LD_PRELOAD=lib)) == f"OpenBLAS {lib} (LD_PRELOAD)"


@linux_only
def test_a_run_uses_the_system_openblas_by_default_and_none_keeps_the_bundled_one(tmp_path):
    lib = openblas()
    default = run_json(tmp_path)
    assert default["blas"] == f"OpenBLAS {lib} (LD_PRELOAD)"  # the first candidate, without a flag
    for flags, env in (((), {"KVLAYOUT_BLAS": "none"}), (("--blas", "none"), {})):
        assert run_json(tmp_path, *flags, **env)["blas"].startswith("reference BLAS bundled with mlx[cpu]")
    # The greedy tokens are the same with either BLAS.
    assert tokens(default) == tokens(run_json(tmp_path, "--blas", "none"))
    assert all(len(ids) == 24 for r in tokens(default) for ids in r)


@linux_only
def test_the_package_indexs_openblas_passes_its_check_even_without_a_system_libgfortran(
        fresh_verdicts, monkeypatch):
    lib = packaged()
    monkeypatch.setattr(blas.ctypes.util, "find_library", lambda name: None)  # as on a machine with only Python
    env = blas.preload_env(lib, {})
    links = Path(env["LD_LIBRARY_PATH"])
    assert (links / "libgfortran.so.5").resolve().parent.name == "mlx_cpu.libs"
    assert blas.check(lib) is None
    assert json.loads((fresh_verdicts / blas.VERDICTS).read_text()) == {blas._verdict_key(lib): "ok"}


@linux_only
def test_auto_takes_the_package_indexs_openblas_where_the_system_has_none(tmp_path, monkeypatch):
    lib = packaged()
    monkeypatch.setattr(blas, "SYSTEM_OPENBLAS", (str(tmp_path / "absent.so"),))
    choice = blas.choose(None, {})
    assert choice.path == lib and choice.env["LD_PRELOAD"] == lib and choice.passed_over == ()


@linux_only
def test_a_candidate_that_fails_its_check_is_named_in_one_line_and_the_next_is_used(
        tmp_path, fresh_verdicts, monkeypatch):
    libm = tmp_path / "libopenblas.so.0"  # a real shared library, but no BLAS
    shutil.copy(next(p for p in ("/lib/x86_64-linux-gnu/libm.so.6", "/lib/aarch64-linux-gnu/libm.so.6",
                                 "/usr/lib64/libm.so.6") if Path(p).is_file()), libm)
    text = tmp_path / "libblas.so.3"
    text.write_text("not a library")
    good = openblas()
    monkeypatch.setattr(blas, "SYSTEM_OPENBLAS", (str(text), str(libm), good))
    choice = blas.choose(None, {})
    assert choice.path == good
    assert len(choice.passed_over) == 2 and all("\n" not in line for line in choice.passed_over)
    assert choice.passed_over[0].startswith(f"BLAS {text} failed its check (it does not load")
    assert choice.passed_over[1] == f"BLAS {libm} failed its check (not a CBLAS: it has no cblas_sgemm, " \
                                    "what MLX calls); not used"


@linux_only
def test_a_verdict_is_kept_until_the_file_changes(tmp_path, fresh_verdicts, monkeypatch):
    lib = tmp_path / "libopenblas.so.0"
    shutil.copy(packaged(), lib)  # self-contained but for libgfortran (Debian's finds its OpenBLAS beside it)
    assert blas.check(str(lib)) is None
    monkeypatch.setattr(blas, "_probe", lambda path: pytest.fail("checked again"))
    assert blas.check(str(lib)) is None  # kept
    lib.write_bytes(b"not a library any more")
    monkeypatch.setattr(blas, "_probe", lambda path: "changed")
    assert blas.check(str(lib)) == "changed"  # another size and time: checked anew


def test_a_blas_named_that_is_not_a_file_or_fails_is_refused_in_one_line(capsys, tmp_path):
    line = refused_in_one_line(capsys, "bench", "--blas", str(tmp_path / "nope.so"), "--quick")
    assert "no such file" in line or "macOS" in line
    text = tmp_path / "text.so"
    text.write_text("not a library")
    for command in (("run", "--prompt", "hi"), ("bench", "--quick"), ("serve", "--port", "0")):
        line = refused_in_one_line(capsys, *command, "--blas", str(text))
        assert f"--blas {text}: it does not load" in line or "macOS" in line


@linux_only
def test_a_refused_blas_changes_nothing_and_runs_nothing(tmp_path):
    text = tmp_path / "text.so"
    text.write_text("not a library")
    done = kvlayout("run", "--prompt", "hi", "--json", "--blas", str(text), env=cli_env(KVLAYOUT_CACHE=str(tmp_path)))
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().count("\n") == 0 and "it does not load" in done.stderr


@linux_only
def test_bench_blas_reruns_the_command_with_it_preloaded(tmp_path):
    lib = openblas()
    done = kvlayout("bench", "--blas", lib, "--quick", "--rows", "fp16", "--out", str(tmp_path), timeout=300)
    assert done.returncode == 0, done.stderr
    assert f"BLAS: OpenBLAS {lib} (LD_PRELOAD)" in done.stdout
    assert json.loads((tmp_path / "bench.json").read_text())["blas"] == f"OpenBLAS {lib} (LD_PRELOAD)"


def test_choose_none_preloads_nothing():
    assert blas.choose("none", {}) == blas.Choice(None)


def test_a_named_directory_is_refused_naming_it(tmp_path):
    with pytest.raises(ConfigError, match=r"a directory, not a library file"):
        blas.choose(str(tmp_path), {})
