"""The Pool interface: one layer's K (or V) storage, `[1, H, slots, D]`, cells on axis 2.

Layouts differ only in which slots they ask for: contiguous runs (`write`) or
scattered cells (`write_cells`). A pool grows by doubling up to `max_slots`
and never renumbers a slot, so indices a layout holds stay valid.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any


class Pool(abc.ABC):
    @property
    @abc.abstractmethod
    def slots(self) -> int:
        """Slots allocated now."""

    @property
    @abc.abstractmethod
    def max_slots(self) -> int:
        """The most slots this pool may ever hold."""

    @property
    @abc.abstractmethod
    def dtype(self) -> Any:
        """The storage dtype; every write is cast to it explicitly."""

    @abc.abstractmethod
    def write(self, start: int, update: Any) -> None:
        """Store `update` (`[1, H, n, D]`) into slots `[start, start + n)`, growing if needed."""

    @abc.abstractmethod
    def write_cells(self, cells: Sequence[int], update: Any) -> None:
        """Store token i of `update` into slot `cells[i]`; the cells are distinct."""

    @abc.abstractmethod
    def read(self, start: int, length: int) -> Any:
        """Slots `[start, start + length)` as `[1, H, length, D]`; past `slots` is refused."""

    # A layout's own step path: every layer of every step comes here, with what it checked already.

    def write_run(self, start: int, update: Any) -> None:
        """`write`, for a layout that has checked what `write` would: `update` is its layer's
        `[1, H, n, D]` (kvlayout.mlx.check_kv) and `[start, start + n)` lies within max_slots (its own
        plan). A pool may skip its checks here; by default this is `write`."""
        self.write(start, update)

    def write_placed(self, cells: Any, update: Any) -> None:
        """`write_cells`, for a layout writing its own placement: `cells` a `kvlayout.mlx.Cells` of
        distinct cells within max_slots, `update` its layer's `[1, H, n, D]` (check_kv), one token a
        cell. A pool may skip its checks here; by default this is `write_cells`."""
        self.write_cells(cells, update)

    def read_run(self, start: int, length: int) -> Any:
        """`read`, for a layout reading slots it wrote (`[start, start + length)` within `slots`): a pool
        may skip its checks here; by default this is `read`."""
        return self.read(start, length)
