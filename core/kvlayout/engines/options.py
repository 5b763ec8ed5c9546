"""How an engine generates and whom it tells: one record both engines are built from.

Built by keyword (`EngineOptions(eos=..., chunk=...)`), so the engines'
constructors take the model, the cache, its face and this record, and a new
option is one field here, not one more position in every call.
"""

from __future__ import annotations

import attrs

from kvlayout.engines.records import Agree, OnProgress, OnToken, Sampling, Stats, ignore_tokens, same_tokens

SPECULATE = ("off", "ngram")  # EngineOptions.speculate's values ([engine] speculate, the CLI's --speculate)


def ignore_progress(done: int) -> None:
    """The OnProgress of a caller that shows no progress."""


@attrs.define(kw_only=True, eq=False)
class EngineOptions:
    """`eos`: the token ids that end a sample. `sampling`: the run's default (a request may carry
    its own). `chunk`: the most prompt tokens one step feeds. `stats` accumulates the run's
    figures; `progress(n)` hears that n planned tokens are done; `on_token` hears every sampled
    token and every sample that ends without one (engines.records.OnToken). `agree` makes the
    step's tokens everyone's (a collective when tensor-parallel). `pipeline`: greedy samples draw
    their next token on the device, a step ahead (engines.ahead); never when `agree` is a
    collective, whose tokens are read on every step. `max_samples` caps the samples a cell engine
    generates at once (a server's `max_sequences`; None: as many as the layout has ids); a seq
    engine generates one at a time. `speculate`: "ngram" drafts up to `speculate_tokens` tokens per
    decoding sample from its own prompt and output and verifies them in the step (engines.drafts);
    "off" (the default): one token per sample per step."""

    eos: frozenset[int] = frozenset()
    sampling: Sampling = attrs.field(factory=Sampling)
    chunk: int = 64
    stats: Stats = attrs.field(factory=Stats)
    progress: OnProgress = ignore_progress
    on_token: OnToken = ignore_tokens
    agree: Agree = same_tokens
    pipeline: bool = True
    max_samples: int | None = None
    speculate: str = "off"
    speculate_tokens: int = 4

    @property
    def draws_ahead(self) -> bool:
        """Whether tokens may be drawn on the device a step ahead: asked for, and agreed in one process."""
        return self.pipeline and self.agree is same_tokens
