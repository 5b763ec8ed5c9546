"""Shared test builders: a tiny attention stack and its cache-free oracle; the `kvlayout`
command run in a subprocess on this tree's code (`kvlayout`, `cli_env`).

The stack has no rotary embedding on purpose: keys depend only on content, so
any mistake in which keys a query sees changes the output. Each layer is
`x + tanh(attend(q, k, v) @ Wo)`; the nonlinearity carries an early layer's
error into every later one.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import mlx.core as mx
import numpy as np

from kvlayout.mlx import attend


class TinyStack:
    def __init__(self, n_layers=3, d_model=32, n_heads=4, n_kv_heads=2, head_dim=8, seed=0):
        rng = np.random.default_rng(seed)
        self.n_layers, self.n_heads, self.n_kv_heads, self.head_dim = n_layers, n_heads, n_kv_heads, head_dim
        self.d_model = d_model
        self.scale = 1.0 / math.sqrt(head_dim)

        def w(rows, cols):
            return mx.array(rng.normal(0, 1 / math.sqrt(rows), (rows, cols)).astype(np.float32))

        self.layers = [
            dict(
                wq=w(d_model, n_heads * head_dim),
                wk=w(d_model, n_kv_heads * head_dim),
                wv=w(d_model, n_kv_heads * head_dim),
                wo=w(n_heads * head_dim, d_model),
            )
            for _ in range(n_layers)
        ]

    def tokens(self, n: int, seed: int) -> mx.array:
        """`n` random input vectors `[1, n, d_model]`, reproducible by seed."""
        rng = np.random.default_rng(1000 + seed)
        return mx.array(rng.normal(0, 1, (1, n, self.d_model)).astype(np.float32))

    def project_qkv(self, p, x):
        """Layer `p`'s q, k, v of `x` `[1, T, d]` (tests that attend themselves use it too)."""
        T = x.shape[1]
        q = (x @ p["wq"]).reshape(1, T, self.n_heads, self.head_dim).transpose(0, 2, 1, 3)  # [1, Hq, T, D]
        k = (x @ p["wk"]).reshape(1, T, self.n_kv_heads, self.head_dim).transpose(0, 2, 1, 3)  # [1, Hkv, T, D]
        v = (x @ p["wv"]).reshape(1, T, self.n_kv_heads, self.head_dim).transpose(0, 2, 1, 3)
        return q, k, v

    def project_out(self, p, x, o):
        """The layer's output: `x` plus its projected attention output `o` `[1, Hq, T, D]`."""
        T = x.shape[1]
        o = o.transpose(0, 2, 1, 3).reshape(1, T, self.n_heads * self.head_dim)
        return x + mx.tanh(o @ p["wo"])

    def forward_cached(self, cache, x: mx.array, positions: Sequence[int]) -> mx.array:
        """Run `x` `[1, T, d]` through every layer via `cache.update_and_fetch`."""
        for layer, p in enumerate(self.layers):
            q, k, v = self.project_qkv(p, x)
            spec = cache.update_and_fetch(layer, list(positions), k, v)
            x = self.project_out(p, x, attend(q, spec, self.scale))
        return x

    def forward_parts(self, cache, parts) -> list[mx.array]:
        """One step over `[(seq, x [1, n, d], first_pos), ...]` through a cell cache (declared here);
        each part's output rows."""
        seqs = [s for s, x, _ in parts for _ in range(x.shape[1])]
        positions = [p + i for _, x, p in parts for i in range(x.shape[1])]
        assert cache.as_batch_control().declare_step(seqs)
        out = self.forward_cached(cache, mx.concatenate([x for _, x, _ in parts], axis=1), positions)
        splits = np.cumsum([x.shape[1] for _, x, _ in parts])[:-1].tolist()
        return mx.split(out, splits, axis=1) if splits else [out]

    def forward_reference(self, x: mx.array, windows: Sequence[int] = ()) -> mx.array:
        """Cache-free forward over a whole sequence; windows[l] > 0 makes layer l sliding-window."""
        T = x.shape[1]
        i = np.arange(T)[:, None]
        j = np.arange(T)[None, :]
        for layer, p in enumerate(self.layers):
            w = windows[layer] if layer < len(windows) else 0
            allowed = j <= i
            if w:
                allowed &= j >= i - w + 1
            q, k, v = self.project_qkv(p, x)
            k = mx.repeat(k, self.n_heads // self.n_kv_heads, axis=1)
            v = mx.repeat(v, self.n_heads // self.n_kv_heads, axis=1)
            scores = (q @ k.transpose(0, 1, 3, 2)) * self.scale  # [1, Hq, T, T]
            scores = mx.where(mx.array(allowed), scores, -mx.inf)
            o = mx.softmax(scores, axis=-1) @ v
            x = self.project_out(p, x, o)
        return x


def refused_in_one_line(capsys, *argv: str) -> str:
    """Run `kvlayout ARGV` in-process: exit 2, one `kvlayout: error:` line on stderr, no traceback; that line."""
    from kvlayout.cli import main

    assert main(list(argv)) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvlayout: error: "), err
    assert "Traceback" not in err
    return lines[0]


# -- the `kvlayout` command in a subprocess, running this tree's code ---------------------------

ROOT = Path(__file__).resolve().parents[1]
CLI_PATH = os.pathsep.join(str(ROOT / p) for p in ("core", "plugins/seq_layout", "plugins/cell_layout"))


def cli_env(**extra: str) -> dict[str, str]:
    """The environment for a `kvlayout` subprocess: this tree on PYTHONPATH, KVLAYOUT_STRICT unset, and
    the BLAS chosen as a user's command chooses it (kvlayout.runner.blas)."""
    env = {**os.environ, "PYTHONPATH": CLI_PATH, "COLUMNS": "100", **extra}
    if "KVLAYOUT_STRICT" not in extra:
        env.pop("KVLAYOUT_STRICT", None)
    if "KVLAYOUT_BLAS_CHOSEN" not in extra:  # the test process's mark (tests/conftest.py): a command chooses anew
        env.pop("KVLAYOUT_BLAS_CHOSEN", None)
    return env


def kvlayout(*argv: str | bytes, stdin: bytes | None = b"", redirect: str = "", env: dict | None = None,
             cwd: Path | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run `python -m kvlayout.cli ARGV` (text out, bytes in); `redirect` is a shell redirection of its
    standard input (`<&-` closes it, `< /` makes it a directory)."""
    cmd = [sys.executable, "-m", "kvlayout.cli", *argv]
    if redirect:
        cmd = ["sh", "-c", f'exec "$@" {redirect}', "sh", *cmd]
        stdin = None
    done = subprocess.run(cmd, input=stdin, capture_output=True, env=env or cli_env(), cwd=cwd, timeout=timeout)
    return subprocess.CompletedProcess(done.args, done.returncode, done.stdout.decode(errors="replace"),
                                       done.stderr.decode(errors="replace"))
