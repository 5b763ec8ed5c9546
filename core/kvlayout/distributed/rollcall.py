"""Before the ring backend's join, a roll call that gives up: every rank reports to rank 0 in time.

`mx.distributed.init()` over the ring blocks in accept() until the rank before it
connects, and MLX gives that wait no timeout; it holds the GIL there, so no thread of
this process could end it either. So the ranks meet first on their own, over the
addresses the hostfile gives: every other rank connects to rank 0's (its first) and
says which rank it is; once all have, rank 0 closes that listener and answers "go",
and only then does any rank start the ring's join, whose peers are then known to be
up. Past the deadline rank 0 names the ranks that never reported, and answers the
ones that did with that list, so each of them names them too; a rank that cannot
reach rank 0 names rank 0. The ring then binds rank 0's address anew: the listener
is closed before "go", so no rank's ring connection can land on it.

A rank that dies after the roll call and before the ring's join completes would
still leave the others in that accept() for good, so the join runs under
`JoinWatch`: a small watcher process (a thread of this one could not run), which
past the timeout names the join that never completed and ends this process.

Only the ring backend's launch (MLX_RANK and a hostfile listing two ranks or more)
has its roll call; MPI's mpirun and jaccl's coordinator join the ranks themselves.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import attrs

from kvlayout.errors import DistributedError, os_reason

HELLO = "kvlayout-join"  # what a rank says first: "kvlayout-join RANK SIZE"
GO = "go"  # rank 0's answer when every rank reported; else "missing R ..."
RETRY_S = 0.2  # between a rank's attempts to reach rank 0, which may not listen yet
LATE_S = 5.0  # how much longer than the timeout a rank waits for rank 0's answer, which may start later


@attrs.frozen
class Ring:
    """This process's rank in a ring backend's launch, and every rank's address (its first) in rank order."""

    rank: int
    addresses: tuple[str, ...]

    @property
    def size(self) -> int:
        return len(self.addresses)

    def label(self) -> str:
        return f"rank {self.rank} of {self.size}"

    def named(self, ranks: list[int]) -> str:
        """`ranks` with their addresses: "rank 1 (127.0.0.1:5001)", "ranks 1 (...) and 2 (...)"."""
        each = [f"{r} ({self.addresses[r]})" for r in ranks]
        listed = each[0] if len(each) == 1 else f"{', '.join(each[:-1])} and {each[-1]}"
        return f"rank{'s' if len(each) > 1 else ''} {listed}"

    def host_port(self, rank: int) -> tuple[str, int]:
        host, _, port = self.addresses[rank].partition(":")  # split at the first colon, as MLX does
        return host, int(port)


def ring_from_environment() -> Ring | None:
    """The ring backend's launch this process belongs to (MLX_RANK, MLX_HOSTFILE), or None when it is
    none, holds one rank, or its hostfile or rank cannot be read: the ring's own join then says why.
    DistributedError, one line, for a port past 0..65535, on which that join would wait forever."""
    hostfile, rank = os.environ.get("MLX_HOSTFILE"), os.environ.get("MLX_RANK")
    if not hostfile or rank is None or "OMPI_COMM_WORLD_SIZE" in os.environ:
        return None
    try:
        nodes = json.loads(Path(hostfile).read_text())
        ring = Ring(int(rank), tuple(node[0] for node in nodes))
        ports = [ring.host_port(r)[1] for r in range(ring.size)]  # each a "host:port"
    except (OSError, ValueError, TypeError, KeyError, IndexError, AttributeError):  # an address no string
        return None
    if ring.size < 2 or not 0 <= ring.rank < ring.size:
        return None
    bad = [r for r, port in enumerate(ports) if not 0 <= port <= 65535]
    if bad:  # MLX's join does not refuse it: it waits forever
        raise DistributedError(f"MLX_HOSTFILE {hostfile}: {ring.named(bad)}: a port past 0..65535")
    return ring


def roll_call(ring: Ring, timeout_s: float, setting: str) -> None:
    """Returns once every rank of `ring` reported to rank 0 (the ring's join may start); DistributedError
    naming the ranks that did not, and their addresses, past `timeout_s` (`setting`: what sets it)."""
    if ring.rank == 0:
        _call_the_roll(ring, timeout_s, setting)
    else:
        _report(ring, timeout_s, setting)


def _call_the_roll(ring: Ring, timeout_s: float, setting: str) -> None:
    deadline = time.monotonic() + timeout_s
    try:
        listener = socket.create_server(ring.host_port(0), backlog=ring.size)
    except OSError:
        return  # the ring's own join binds the same address next, and says why it cannot
    reported: dict[int, socket.socket] = {}
    try:
        with listener:  # closed before any answer: the ring's join binds this address anew
            while len(reported) < ring.size - 1 and (left := deadline - time.monotonic()) > 0:
                listener.settimeout(left)
                try:
                    conn, _ = listener.accept()
                except TimeoutError:
                    break
                rank = _hello(conn, ring, deadline)
                if rank is None or rank in reported:
                    conn.close()  # not a rank of this launch
                    continue
                reported[rank] = conn
        missing = [r for r in range(1, ring.size) if r not in reported]
        answer = GO if not missing else " ".join(["missing", *map(str, missing)])
        for conn in reported.values():
            try:
                conn.sendall(f"{answer}\n".encode())
            except OSError:
                pass  # that rank is gone: its ring join fails on its own
    finally:
        for conn in reported.values():
            conn.close()
    if missing:
        there = ring.addresses[0]
        raise DistributedError(
            f"{ring.label()}: {ring.named(missing)} did not join within {timeout_s:g} s (never started, or "
            f"cannot reach rank 0 at {there}; {setting} sets the bound)"
        )


def _hello(conn: socket.socket, ring: Ring, deadline: float) -> int | None:
    """The rank `conn` says it is, or None when it says something else (or nothing in time)."""
    line = _line(conn, deadline)
    words = (line or "").split()
    if len(words) != 3 or words[0] != HELLO or words[2] != str(ring.size) or not words[1].isdigit():
        return None
    rank = int(words[1])
    return rank if 0 < rank < ring.size else None


def _report(ring: Ring, timeout_s: float, setting: str) -> None:
    deadline = time.monotonic() + timeout_s
    leader = ring.named([0])
    while True:
        try:
            conn = socket.create_connection(ring.host_port(0), timeout=max(0.1, min(2.0, deadline - time.monotonic())))
            break
        except OSError:
            if time.monotonic() >= deadline:
                raise DistributedError(
                    f"{ring.label()}: {leader} did not answer within {timeout_s:g} s (never started, or cannot "
                    f"be reached from here; {setting} sets the bound)"
                ) from None
            time.sleep(RETRY_S)
    with conn:
        try:
            conn.sendall(f"{HELLO} {ring.rank} {ring.size}\n".encode())
        except OSError:
            pass  # said below: no answer
        # Rank 0 answers within the timeout from its own start, which may come after this rank's.
        answer = _line(conn, time.monotonic() + timeout_s + LATE_S)
    word, *missing = (answer or "").split() or [""]
    if word == GO and not missing:
        return
    if word == "missing" and missing and all(w.isdigit() and 0 < int(w) < ring.size for w in missing):
        raise DistributedError(
            f"{ring.label()}: {ring.named([int(w) for w in missing])} did not join within {timeout_s:g} s "
            f"(as rank 0 found; {setting} sets the bound)"
        )
    raise DistributedError(f"{ring.label()}: {leader} ended the ranks' roll call without an answer (it died, "
                           "or is no kvlayout of this launch)")


def _line(conn: socket.socket, deadline: float) -> str | None:
    """One line from `conn` (at most 256 bytes) before `deadline`, or None (closed, silent, or too long)."""
    got = b""
    while b"\n" not in got and len(got) <= 256:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        conn.settimeout(left)
        try:
            part = conn.recv(256)
        except OSError:  # a timeout too
            return None
        if not part:
            return None
        got += part
    line, newline, _ = got.partition(b"\n")
    return line.decode("ascii", "replace") if newline else None


# The watcher: waits for its stdin to close (the join ended, or this process did) up to a timeout; past it,
# says why on the stderr it shares with this process and ends this process (no Python can run in it then).
_WATCHER = (
    "import os, select, signal, sys\n"
    "ready, _, _ = select.select([sys.stdin], [], [], float(sys.argv[2]))\n"
    "if not ready:\n"
    "    sys.stderr.write(sys.argv[3])\n"
    "    sys.stderr.flush()\n"
    "    os.kill(int(sys.argv[1]), signal.SIGKILL)\n"
)


class JoinWatch:
    """Ends this process, saying so, when the block it guards (the ring backend's join, which holds the
    GIL in accept() with no timeout) runs past `timeout_s`: the watcher is another process, told the
    block ended by the closing of its stdin."""

    def __init__(self, ring: Ring, timeout_s: float, setting: str):
        self.label = ring.label()
        self.message = (
            f"kvlayout: error: {ring.label()}: the ranks' ring did not form within {timeout_s:g} s after every "
            f"rank answered the roll call (a rank died or hangs while joining; {setting} sets the bound)\n"
        )
        self.timeout_s = timeout_s
        self.watcher: subprocess.Popen | None = None

    def __enter__(self) -> JoinWatch:
        try:
            self.watcher = subprocess.Popen(
                [sys.executable, "-c", _WATCHER, str(os.getpid()), str(self.timeout_s), self.message],
                stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, start_new_session=True,
            )
        except OSError as exc:  # no process to spare: an unbounded join is not started either
            why = os_reason(exc)
            raise DistributedError(f"{self.label}: cannot start the watch over the ring's join ({why})") from None
        return self

    def __exit__(self, *exc) -> None:
        watcher, self.watcher = self.watcher, None
        if watcher is not None:
            watcher.stdin.close()  # the join ended: the watcher leaves without a word
            watcher.wait()
