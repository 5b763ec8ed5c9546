"""What a run returns: every sample's tokens and text, the statistics, whether it finished.

The engines fill the records of kvlayout.engines.records; the runner's job
turns them into a RunResult.
"""

from __future__ import annotations

import attrs

from kvlayout.engines.records import Request, Stats


@attrs.frozen
class SampleResult:
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
class RunResult:
    requests: list[Request] = attrs.field(repr=False)
    outputs: list[list[SampleResult]]
    stats: Stats
    prompts: list[str]
    complete: bool = True  # False: stopped early (Ctrl-C with --save-state); samples left unfinished

    def to_json(self) -> dict:
        return {
            "layout": self.stats.layout,
            "kv_dtype": self.stats.kv_dtype,
            "model": self.stats.model,
            "requests": [
                {
                    "index": r.index,
                    "prompt": self.prompts[r.index],
                    "prompt_tokens": len(r.prompt),
                    "samples": [s.to_json() for s in self.outputs[r.index]],
                }
                for r in self.requests
            ],
            "stats": self.stats.to_json(),
        }
