"""What a run returns: every sample's tokens and text, the statistics, whether it finished;
and what it tells as it goes (`TextEvent`).

The engines fill the records of kvlayout.engines.records; the runner's job
turns them into a RunResult.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

from kvlayout.engines.records import Request, Stats
from kvlayout.mlx.pool import cell_bytes


@attrs.frozen
class TextEvent:
    """A sample's new text, as it is generated (`Job.generate(on_text=...)`).

    `text` is what the sample's text grew by and may be "": never half a
    character, never what might start a stop string, never past one; the
    `text` of a sample's events joins to its final text. `token` is the id
    just sampled (None when the sample failed); `finish_reason` is set on
    the sample's last event.
    """

    request: int
    sample: int
    token: int | None
    text: str
    finish_reason: str | None = None


OnText = Callable[[TextEvent], None]


@attrs.frozen
class SampleResult:
    """A sample's tokens (all it generated: the last one may hold a stop string) and its text
    (cut before the stop string, if one came)."""

    token_ids: list[int]
    text: str
    finish_reason: str  # "stop", "length", "error", or "pending" (the run stopped first; resume it)
    error: str | None = None

    def to_json(self) -> dict:
        out = {"token_ids": self.token_ids, "text": self.text, "finish_reason": self.finish_reason}
        if self.error is not None:
            out["error"] = self.error
        return out


@attrs.frozen
class KVBytes:
    """What `cells` cells of a cache hold in K/V (every layer's K and V), in its kv_dtype and as
    float16 would hold the same cells. A run reports its peak; a server, the cells used now.

    `window_cells`: a cell layout keeping its sliding-window layers' cells in tables of their own
    (kvlayout_cell.layer_groups): how many those hold, `cells` being the flat layers'; None: every
    layer holds `cells`. With windows of more than one size, the largest window table's count
    stands for all of them (an upper bound)."""

    kv_dtype: str
    per_cell: int
    float16_per_cell: int
    cells: int
    window_cells: int | None = None
    window_per_cell: int = 0  # of per_cell, what the sliding-window layers take
    window_float16_per_cell: int = 0

    @classmethod
    def of(cls, config: Any, cells: int, window_cells: int | None = None) -> KVBytes:
        split = {} if window_cells is None else {
            "window_cells": window_cells,
            "window_per_cell": cell_bytes(config, windowed=True),
            "window_float16_per_cell": cell_bytes(config, "float16", windowed=True),
        }
        return cls(config.kv_dtype, cell_bytes(config), cell_bytes(config, "float16"), cells, **split)

    @property
    def held(self) -> int:
        return self._bytes(self.per_cell, self.window_per_cell)

    @property
    def float16_held(self) -> int:
        return self._bytes(self.float16_per_cell, self.window_float16_per_cell)

    def _bytes(self, per_cell: int, window_per_cell: int) -> int:
        if self.window_cells is None:
            return per_cell * self.cells
        return (per_cell - window_per_cell) * self.cells + window_per_cell * self.window_cells

    def to_json(self) -> dict:
        out = {
            "kv_dtype": self.kv_dtype,
            "cells": self.cells,
            "per_cell": self.per_cell,
            "held": self.held,
            "float16_per_cell": self.float16_per_cell,
            "float16_held": self.float16_held,
        }
        if self.window_cells is not None:
            out.update(window_cells=self.window_cells, window_per_cell=self.window_per_cell)
        return out


@attrs.frozen
class RunResult:
    requests: list[Request] = attrs.field(repr=False)
    outputs: list[list[SampleResult]]
    stats: Stats
    prompts: list[str]  # the prompt text each request ran (a chat as its template rendered it)
    complete: bool = True  # False: stopped early (Ctrl-C with --save-state); samples left unfinished
    messages: list[list[dict] | None] = attrs.field(factory=list)  # a chat request's messages, else None
    # With a save_state: None when the state was saved, else the error saying why not and what
    # the directory holds now (resume.SaveFailed); the run's outputs are here all the same.
    save_failed: Exception | None = None
    kv_bytes: KVBytes | None = None  # None: not measured (a result built outside a Job)
    blas: str = ""  # the BLAS the run's matmuls used (runner.blas.in_use); "" when not known

    def to_json(self) -> dict:
        return {
            "complete": self.complete,
            "layout": self.stats.layout,
            "kv_dtype": self.stats.kv_dtype,
            "model": self.stats.model,
            "requests": [
                {
                    "index": r.index,
                    "prompt": self.prompts[r.index],
                    **({"messages": self.messages[r.index]} if self.messages and self.messages[r.index] else {}),
                    "prompt_tokens": len(r.prompt),
                    "samples": [s.to_json() for s in self.outputs[r.index]],
                }
                for r in self.requests
            ],
            "stats": self.stats.to_json(),
            **({"kv_bytes": self.kv_bytes.to_json()} if self.kv_bytes is not None else {}),
            **({"blas": self.blas} if self.blas else {}),
        }
