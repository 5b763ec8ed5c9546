"""What a tensor-parallel `kvlayout run` does on each rank around the Job.

Rank 0 reads the config (file, flags, `--prompt -` from its stdin) and
hands it to every other rank as TOML through a collective; each rank then
loads the model and keeps its shard, renders and tokenizes the same
requests (checked equal to rank 0's), and runs the same engine over its
own cache. Only rank 0 prints; the others' stdout is discarded. Saved state
goes to one directory per rank under the one named (`rank-R-of-N`), and a
resume finds its own: another world size is refused, naming what the
directory holds.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import attrs

from kvlayout.distributed import World
from kvlayout.errors import KVLayoutError, LeaderRefused, StateError
from kvlayout.runner.config import RunConfig, dump_config, parse_config

RANK_DIR = re.compile(r"rank-(\d+)-of-(\d+)")


def leader_config(world: World, make: Callable[[], RunConfig]) -> RunConfig:
    """Rank 0's config on every rank: `make()` runs on rank 0 only; a KVLayoutError there reaches the
    others as LeaderRefused (so every rank stops, rank 0 saying why)."""
    if world.leader:
        try:
            cfg = make()
        except KVLayoutError as exc:
            world.json_from_leader({"refused": str(exc)}, "the run's config")
            raise
        # plain_chat is no TOML key (a --prompt run's, or a fallback's): it goes beside the text.
        world.json_from_leader({"toml": dump_config(cfg), "plain_chat": cfg.plain_chat}, "the run's config")
        return cfg
    got = world.json_from_leader(None, "the run's config")
    if "refused" in got:
        raise LeaderRefused(f"{world.label()}: stopped: rank 0 refused the run ({got['refused']})")
    return attrs.evolve(parse_config(got["toml"], "rank 0's config"), plain_chat=got["plain_chat"])


@contextlib.contextmanager
def quiet_unless_leader(world: World) -> Iterator[None]:
    """Rank 0 prints; every other rank's stdout goes nowhere for the run (its errors still reach stderr)."""
    if world.leader:
        yield
        return
    saved = sys.stdout
    with open(os.devnull, "w") as devnull:
        sys.stdout = devnull
        try:
            yield
        finally:
            sys.stdout = saved


def rank_dir(directory: str | None, world: World) -> str | None:
    """Where this rank saves or resumes: `directory` in one process, its `rank-R-of-N` inside it else."""
    if directory is None or not world.distributed:
        return directory
    return str(Path(directory) / f"rank-{world.rank}-of-{world.size}")


def check_resume_world(directory: str | None, world: World) -> None:
    """StateError when `directory` was saved by a run of another world size than this one's."""
    if directory is None or not Path(directory).is_dir():
        return
    sizes = sorted({int(m.group(2)) for p in Path(directory).iterdir() if (m := RANK_DIR.fullmatch(p.name))})
    if not sizes and world.distributed:
        raise StateError(
            f"--resume {directory}: saved by a run in one process; this run has {world.size} ranks "
            "(resume it without mlx.launch)"
        )
    if sizes and sizes != [world.size]:
        held = " and ".join(f"{n} ranks" for n in sizes)
        now = f"{world.size} ranks" if world.distributed else "one process"
        raise StateError(
            f"--resume {directory}: saved by a run of {held}; this run has {now} "
            f"(resume it with mlx.launch -n {sizes[0]})"
        )


def agree_on_save(world: World, result: Any, directory: str) -> Any:
    """`result` (a RunResult), its `save_failed` set when another rank could not save its shard
    (each rank says its own reason on its stderr): `directory` then holds no whole run."""
    every = world.gather_ints([0 if result.save_failed is None else 1], "whether each rank saved its state")
    lost = [r for r, (failed,) in enumerate(every) if failed and r != world.rank]
    if not lost or result.save_failed is not None:
        return result
    which = ", ".join(map(str, lost))
    why = KVLayoutError(f"rank(s) {which} could not save their shard (said on their stderr); {directory} "
                        "does not hold a whole run: resume from it is refused")
    return attrs.evolve(result, save_failed=why)


def rank_figures(world: World, kv_bytes_per_cell: int, model_bytes: int) -> list[dict[str, Any]]:
    """Every rank's K/V bytes a cell and model bytes (a collective: every rank calls it)."""
    every = world.gather_ints([kv_bytes_per_cell, model_bytes], "each rank's K/V and model bytes")
    return [{"rank": r, "kv_bytes_per_cell": kv, "model_bytes": mb} for r, (kv, mb) in enumerate(every)]
