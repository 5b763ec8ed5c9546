"""What every bench script shares: a timer, the table it prints, the JSON it writes, and for the scripts
that start servers, a free port, the wait for one to come up and its stop.

Scripts run as `python bench/NAME.py`, which puts this folder on sys.path. MLX is imported only by
`write_json`, so a standard-library script (serve_probe.py) can use the rest.
"""

from __future__ import annotations

import json
import platform
import socket
import subprocess
import time
from collections.abc import Callable, Sequence
from typing import Any

# A column: header, row key, format spec (the width comes from the header).
Column = tuple[str, str, str]


def time_us(fn: Callable[[], object]) -> float:
    start = time.perf_counter_ns()
    fn()
    return (time.perf_counter_ns() - start) / 1e3


def table(columns: Sequence[Column], rows: Sequence[dict]) -> str:
    """Right-aligned columns, each as wide as its header (at least 6), under a rule."""
    widths = [max(len(head), 6) for head, _, _ in columns]
    head = " ".join(f"{h:>{w}}" for (h, _, _), w in zip(columns, widths))
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(" ".join(f"{r[key]:>{w}{fmt}}" for (_, key, fmt), w in zip(columns, widths)))
    return "\n".join(lines)


def write_json(path: str | None, bench: str, **fields: Any) -> None:
    """The figures plus where they were measured; nothing when no path was given."""
    if not path:
        return
    import mlx.core as mx

    payload = {"bench": bench, "device": str(mx.default_device()), "mlx": mx.__version__,
               "machine": platform.platform(), **fields}
    with open(path, "w") as f:
        json.dump(payload, f, indent=2)


def free_port(host: str = "127.0.0.1") -> int:
    """A port of `host` nothing listens on now (a server started next binds it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_up(proc: subprocess.Popen, ready: Callable[[], bool], bound_s: float, what: str) -> None:
    """Poll `ready()` every 0.2 s until it says True. RuntimeError naming `what` if `proc` exits first, or,
    after stopping it, if it is not ready within `bound_s`."""
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited ({proc.returncode})")
        if ready():
            return
        time.sleep(0.2)
    stop(proc)
    raise RuntimeError(f"{what} did not come up in {bound_s:.0f} s")


def stop(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL if `proc` has not exited after `grace_s`; reaped either way."""
    proc.terminate()
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(grace_s)
