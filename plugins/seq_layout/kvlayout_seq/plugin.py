"""Entry point of kvlayout-seq: the hooks kvlayout calls.

The MLX face is imported only when a cache is built, so discovering the
layout (`kvlayout plugins`, `available()`) never loads MLX.
"""

from __future__ import annotations

from typing import Any

from kvlayout import Builder, hookimpl


def build_seq(config: Any):
    """A SeqCache for `config` (a CacheConfig, or a mapping of its fields)."""
    from kvlayout_seq.mlx_cache import SeqCache

    return SeqCache(config)


def load_seq_cache(state_file: Any):
    """A SeqCache from a `kvlayout.persist.StateFile` its `save` wrote."""
    from kvlayout_seq.mlx_cache import load_cache

    return load_cache(state_file)


@hookimpl
def kvlayout_builders() -> list[Builder]:
    return [
        Builder(
            backend_id="mlx",
            kind="seq",
            build=build_seq,
            summary="one sequence; per layer flat (all history) or ring (sliding window); rewind",
            load=load_seq_cache,
        )
    ]
