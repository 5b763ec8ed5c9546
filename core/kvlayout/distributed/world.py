"""The ranks of a tensor-parallel run (`mlx.launch`), and what they say to each other.

A process started by `mlx.launch` (ring over TCP, MPI, or jaccl on Apple
hardware) finds `MLX_RANK` (or MPI's `OMPI_COMM_WORLD_SIZE`) in its
environment and joins the group with `mx.distributed.init()`; any other
process is a world of one, where every collective below is the identity and
nothing is initialised.

Everything the ranks exchange goes through `mx.distributed` collectives
(`all_sum`, `all_gather`), never a side channel: rank 0's bytes (a config,
a step's new requests) reach the others as an all_sum in which every other
rank contributes zeros, and so do rank 0's sampled tokens.

A collective that does not complete (a rank died, or hangs) would block the
others forever; the ring backend has no timeout. Each collective is run
under `Watchdog`: past its deadline the process says which rank it is,
what it waited for, and exits (EXIT_STALLED), so `mlx.launch` ends the
others too. The ring's join has no timeout either, and no thread can end it
(MLX holds the GIL in its accept()): the ranks first answer a roll call
that gives up (`rollcall`), naming the ranks that never joined.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

import attrs
import mlx.core as mx
import numpy as np

from kvlayout.distributed.rollcall import JoinWatch, ring_from_environment, roll_call
from kvlayout.errors import DistributedError

LAUNCHED_BY = ("MLX_RANK", "OMPI_COMM_WORLD_SIZE")  # mlx.launch's ring/jaccl backends; MPI
TIMEOUT_ENV = "KVLAYOUT_COLLECTIVE_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 300.0  # a step's forward runs inside its collectives: a long prefill must fit
CHECK_ENV = "KVLAYOUT_CHECK_RANKS"  # "1": compare every rank's table checksum each step
EXIT_STALLED = 75


def launched() -> bool:
    """Whether this process was started as one rank of several (by mlx.launch or mpirun)."""
    return any(name in os.environ for name in LAUNCHED_BY)


@attrs.define(eq=False)
class World:
    """This process's rank among `size`; `group` is the mx.distributed group (None: a world of one)."""

    rank: int = 0
    size: int = 1
    group: Any = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    check_tables: bool = False

    @property
    def distributed(self) -> bool:
        return self.size > 1

    @property
    def leader(self) -> bool:
        """Rank 0: the one that reads the config, tokenizes, samples and prints (or serves HTTP)."""
        return self.rank == 0

    def label(self) -> str:
        return f"rank {self.rank} of {self.size}"

    # -- collectives (each the identity in a world of one)

    def all_sum(self, x: mx.array, what: str) -> mx.array:
        """`mx.distributed.all_sum` of `x`, evaluated under the watchdog (`what`: the message's words)."""
        if not self.distributed:
            return x
        return self.evaluated(lambda: mx.distributed.all_sum(x, group=self.group), what)

    def all_gather(self, x: mx.array, what: str) -> mx.array:
        """Every rank's `x` `[n, ...]`, rank order, concatenated on axis 0, under the watchdog."""
        if not self.distributed:
            return x
        return self.evaluated(lambda: mx.distributed.all_gather(x, group=self.group), what)

    def evaluated(self, make: Callable[[], Any], what: str) -> Any:
        """`make()` evaluated under the watchdog; a lost peer (the backend's RuntimeError) or any other
        failure as DistributedError naming this rank and `what` was being exchanged."""
        try:
            with Watchdog(self, what):
                out = make()
                mx.eval(out)
            return out
        except DistributedError:
            raise
        except Exception as exc:  # noqa: BLE001 - one rank cannot go on alone: whatever it was, the run ends
            lost = "connection" in str(exc) and "lost" in str(exc)
            why = "lost its connection to another rank" if lost else "failed"
            raise DistributedError(
                f"{self.label()}: {why} while computing {what} ({type(exc).__name__}: {exc})"
            ) from exc

    def from_leader(self, data: bytes | None, what: str) -> bytes:
        """Rank 0's `data` on every rank (the others pass None): its length, then its bytes."""
        if not self.distributed:
            return data or b""
        mine = data if self.leader else b""
        n = int(self.all_sum(mx.array([len(mine)], dtype=mx.int32), f"{what} (its length)").item())
        if n == 0:
            return b""
        buf = np.zeros(n, dtype=np.uint8)
        if self.leader:
            buf[:] = np.frombuffer(mine, dtype=np.uint8)
        # uint8 sums would wrap nothing here: every other rank adds zeros.
        return bytes(np.array(self.all_sum(mx.array(buf), what)).astype(np.uint8))

    def json_from_leader(self, obj: Any, what: str) -> Any:
        """Rank 0's `obj` (plain JSON) on every rank."""
        data = json.dumps(obj, sort_keys=True).encode() if self.leader else None
        return json.loads(self.from_leader(data, what))

    def agree_tokens(self, tokens: list[int], digest: Callable[[], bytes] | None = None) -> list[int]:
        """The step's tokens as rank 0 drew them, on every rank (the engines' Agree). With
        `check_tables` and a `digest`, every rank's digest of its table is compared first."""
        if not self.distributed:
            return tokens
        if self.check_tables and digest is not None:
            self.same_everywhere(digest(), "the cache's table after the step")
        mine = np.array(tokens if self.leader else [0] * len(tokens), dtype=np.int64).astype(np.int32)
        if not mine.size:
            return tokens
        got = np.array(self.all_sum(mx.array(mine), "the step's sampled tokens")).astype(int).tolist()
        return got

    def leaders_stop(self, stop: Callable[[], bool] | None) -> Callable[[], bool] | None:
        """`stop` (asked before each step) as rank 0 answers it, on every rank: one small all_sum a
        step, so every rank stops after the same step (a Ctrl-C reaches the ranks at different
        moments, and a rank that stopped alone would leave the others waiting in a forward)."""
        if not self.distributed or stop is None:
            return stop

        def agreed() -> bool:
            mine = 1 if (self.leader and stop()) else 0
            if not self.leader:
                stop()  # a rank's own Ctrl-C is noted, not acted on: rank 0 decides
            return bool(self.all_sum(mx.array([mine], dtype=mx.int32), "rank 0's word to stop or go on").item())

        return agreed

    def same_everywhere(self, data: bytes, what: str) -> None:
        """DistributedError naming the ranks whose `data` (hashed) differs from rank 0's."""
        if not self.distributed:
            return
        mine = np.frombuffer(hashlib.sha256(data).digest(), dtype=np.uint8).astype(np.int32)[None]  # [1, 32]
        every = np.array(self.all_gather(mx.array(mine), f"the checksums of {what}"))  # [size, 32]
        differ = [r for r in range(self.size) if not np.array_equal(every[r], every[0])]
        if differ:
            ranks = ", ".join(map(str, differ))
            raise DistributedError(f"{self.label()}: {what} differs from rank 0's on rank(s) {ranks}")

    def gather_ints(self, values: list[int], what: str) -> list[list[int]]:
        """Every rank's `values` (the same count everywhere), rank order."""
        if not self.distributed:
            return [list(values)]
        # int32 on the wire (what every backend sums): each value as its (high, low) 24-bit halves.
        parts = np.array([[v >> 24, v & 0xFFFFFF] for v in values], dtype=np.int32).reshape(1, -1)
        every = np.array(self.all_gather(mx.array(parts), what)).astype(np.int64).reshape(self.size, -1, 2)
        return [[int(h) << 24 | int(lo) for h, lo in rank] for rank in every]


class RankedModel:
    """A model whose every forward is evaluated under the world's watchdog; a failure on this rank
    (a lost peer inside an all_sum, or anything else) is a DistributedError, which ends the run:
    the engines retry a failed step, but one rank cannot retry alone while the others go on."""

    def __init__(self, model: Any, world: World):
        self.model, self.world = model, world

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)

    def __call__(self, *args: Any, **kwargs: Any) -> mx.array:
        return self.world.evaluated(lambda: self.model(*args, **kwargs), "a forward (its all_sums)")


class Watchdog:
    """Exits the process (EXIT_STALLED) when the block it guards runs past the world's timeout:
    a collective whose peer died or hangs never returns, and the ring backend has no timeout."""

    def __init__(self, world: World, what: str):
        self.world, self.what = world, what
        self.done = threading.Event()

    def __enter__(self) -> Watchdog:
        threading.Thread(target=self._watch, daemon=True, name="kvlayout-watchdog").start()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()

    def _watch(self) -> None:
        if self.done.wait(self.world.timeout_s):
            return
        sys.stderr.write(
            f"kvlayout: error: {self.world.label()}: no answer from the other ranks in "
            f"{self.world.timeout_s:g} s while waiting for {self.what} (a rank died or hangs; "
            f"{TIMEOUT_ENV} sets the bound)\n"
        )
        sys.stderr.flush()
        os._exit(EXIT_STALLED)


_CURRENT: list[World] = []


def current() -> World:
    """This process's World, made once: the launched group, or a world of one."""
    if not _CURRENT:
        _CURRENT.append(_join() if launched() else World())
    return _CURRENT[0]


def _join() -> World:
    timeout = _timeout()
    ring = ring_from_environment()
    if ring is not None:  # every rank known up before the ring's join, which would wait for a missing one forever
        roll_call(ring, timeout, TIMEOUT_ENV)
    try:
        # One that dies after the roll call would still hold the join for good: it is watched from outside.
        with JoinWatch(ring, timeout, TIMEOUT_ENV) if ring is not None else contextlib.nullcontext():
            group = mx.distributed.init()
    except RuntimeError as exc:  # a hostfile that is missing or not a host list, a port taken, ...
        launch = ", ".join(
            f"{name}={os.environ[name]}" for name in (*LAUNCHED_BY, "MLX_HOSTFILE") if name in os.environ
        )
        raise DistributedError(f"cannot join the other ranks ({launch}): {exc}") from None
    if group.size() < 2:
        return World(timeout_s=timeout)
    return World(group.rank(), group.size(), group, timeout, os.environ.get(CHECK_ENV) == "1")


def _timeout() -> float:
    raw = os.environ.get(TIMEOUT_ENV)
    if raw is None:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise DistributedError(f"{TIMEOUT_ENV}={raw!r}: expected a number of seconds > 0")
    return value
