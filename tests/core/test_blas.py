"""Knowing the BLAS: which one a process multiplies with, `kvlayout bench --blas PATH`, and the same
tokens with a system OpenBLAS preloaded as with the reference BLAS MLX's CPU wheel bundles.

The OpenBLAS comes from Debian (`apt-get install libopenblas0-pthread`; `.ci/run` installs it
where it is missing). On Linux without it these tests fail saying so; they never skip.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvlayout.bench.blas import DEBIAN_OPENBLAS
from tests.helpers import cli_env, kvlayout, refused_in_one_line

LINUX = sys.platform.startswith("linux")


def openblas() -> str:
    if not Path(DEBIAN_OPENBLAS).is_file():
        pytest.fail(
            f"no system OpenBLAS at {DEBIAN_OPENBLAS}: run `apt-get install libopenblas0-pthread`", pytrace=False
        )
    return DEBIAN_OPENBLAS


def blas_of(env: dict) -> str:
    code = ("import mlx.core as mx; a = mx.ones((8, 8)); mx.eval(a @ a); "
            "from kvlayout.bench.blas import in_use; print(in_use())")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.mark.skipif(not LINUX, reason="LD_PRELOAD and MLX's bundled BLAS are Linux's")
def test_a_process_names_the_blas_it_multiplies_with():
    assert blas_of(cli_env()).startswith("reference BLAS bundled with mlx[cpu]")
    lib = openblas()
    assert blas_of(cli_env(LD_PRELOAD=lib)) == f"OpenBLAS {lib} (LD_PRELOAD)"


@pytest.mark.skipif(not LINUX, reason="LD_PRELOAD and MLX's bundled BLAS are Linux's")
def test_greedy_tokens_are_the_same_with_openblas_preloaded(tmp_path):
    lib = openblas()
    config = tmp_path / "run.toml"
    config.write_text(
        '[layout]\nbackend = "mlx"\nkind = "cell"\n[cache]\ncapacity = 512\n[model]\npreset = "tiny"\n'
        '[sampling]\ntemperature = 0.0\n'
        '[[requests]]\nprompt = "The cells of a cache, shared by forks"\nmax_tokens = 24\nn = 2\n'
        '[[requests]]\nprompt = "and a second prompt of another length"\nmax_tokens = 24\n'
    )
    runs = {}
    for name, env in (("bundled", cli_env()), ("openblas", cli_env(LD_PRELOAD=lib))):
        done = kvlayout("run", str(config), "--json", env=env)
        assert done.returncode == 0, done.stderr
        runs[name] = [[s["token_ids"] for s in r["samples"]] for r in json.loads(done.stdout)["requests"]]
    assert runs["openblas"] == runs["bundled"]
    assert all(len(ids) == 24 for r in runs["bundled"] for ids in r)


def test_bench_refuses_a_blas_that_is_not_a_file_or_a_library(capsys, tmp_path):
    line = refused_in_one_line(capsys, "bench", "--blas", str(tmp_path / "nope.so"), "--quick")
    assert "no such file" in line or "macOS" in line
    text = tmp_path / "text.so"
    text.write_text("not a library")
    line = refused_in_one_line(capsys, "bench", "--blas", str(text), "--quick")
    assert "not a loadable shared library" in line or "macOS" in line


@pytest.mark.skipif(not LINUX, reason="LD_PRELOAD and MLX's bundled BLAS are Linux's")
def test_bench_blas_reruns_the_command_with_it_preloaded(tmp_path):
    lib = openblas()
    done = kvlayout("bench", "--blas", lib, "--quick", "--rows", "fp16", "--out", str(tmp_path), timeout=300)
    assert done.returncode == 0, done.stderr
    assert f"BLAS: OpenBLAS {lib} (LD_PRELOAD)" in done.stdout
    assert json.loads((tmp_path / "bench.json").read_text())["blas"] == f"OpenBLAS {lib} (LD_PRELOAD)"
