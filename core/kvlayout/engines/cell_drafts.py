"""Speculation in the cell engine's batched step: which sequences draft, and what their rows keep.

Before a step is declared, every decoding sequence whose drafts may pay
proposes one (engines.drafts: its n-gram index, the engine's Pacing); the
scheduler plans it as `1 + len(draft)` tokens of that sequence, and drops
every draft first when the table cannot take the step. The step's forward
returns a row per fed position of a drafting sequence; `keep` draws from
them as the sample would have without speculation, takes the rejected
positions out of the cells (`seq_rm`) and records the kept tokens.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import numpy as np

from kvlayout.engines import drafts
from kvlayout.engines.options import EngineOptions
from kvlayout.engines.records import Sampling
from kvlayout.engines.scheduler import Plan, Running
from kvlayout.faces import BatchControl

Verifying = list[tuple[Running, int]]  # (sequence, positions it feeds: its last token and its draft)


class CellDrafts:
    """The cell engine's drafting, decided by its `pacing` (drafts.pacing_for)."""

    def __init__(self, control: BatchControl, options: EngineOptions, pacing: drafts.Pacing):
        self.bc, self.options, self.stats, self.pacing = control, options, options.stats, pacing

    def sampling(self, s: Running) -> Sampling:
        return s.request.sampling or self.options.sampling

    def may_draft(self, s: Running) -> bool:
        """Whether decoding `s` may draft at all: one plain sample (not shaped, no logprobs) with
        tokens left to gain, its prompt in (`remembered`: a preempted sample fed its last token again
        completes its prompt first)."""
        return (len(s.samples) == 1 and s.remembered and len(s.tokens) > len(s.request.prompt)
                and drafts.may_draft(s.request, s.samples[0], self.options))

    def may_pay(self, s: Running, fed: int) -> bool:
        """Whether `s`'s next step, one like this feeding `fed` tokens, may draft: its token is then
        read on the host (drafts are looked up there), not drawn ahead."""
        if not self.may_draft(s):
            return False
        if s.drafting is None:
            s.drafting = drafts.DraftState()
        return self.pacing.worth_trying(s.drafting, fed)

    def propose(self, plan: Plan) -> None:
        """Give each decoding sequence of `plan` (the running sequences' next step, before admissions)
        whose drafts may pay its draft (Pacing)."""
        fed = sum(k for _, k in plan)
        candidates = []
        for s, k in plan:
            if k != 1 or s.pending != 1 or s.drawn is not None or not self.may_draft(s):
                continue
            if not self.may_pay(s, fed):
                candidates.append((s.drafting, [], 0))  # no chance: not even looked up
                continue
            room = drafts.room(s.request, s.samples[0], self.options.speculate_tokens)
            candidates.append((s.drafting, *s.drafting.index.propose(s.tokens, room)))
        self.pacing.choose(candidates, fed, fed)

    def check(self, verifying: Verifying, logits: mx.array) -> list[mx.array]:
        """Each verifying sequence's rows of `logits` `[sum(d + 1), V]` as `drafts.verify` reads them,
        queued on the device."""
        out, at = [], 0
        for s, n in verifying:
            out.append(drafts.verify_rows(logits[at : at + n], self.sampling(s).temperature == 0.0))
            at += n
        mx.async_eval(out)
        return out

    def keep(self, verifying: Verifying, checked: list[np.ndarray], advance: Callable[[Running, int], bool]) -> int:
        """Keep what each verifying sequence's rows say of its draft (drafts.verify): its rejected
        positions leave the cells, its kept tokens go to `advance` in order (True: that ended it).
        The draft tokens kept, in all."""
        kept = [drafts.verify(s.drafting.draft, rows, self.sampling(s), s.samples[0].rng)
                for (s, _), rows in zip(verifying, checked)]
        accepted = 0
        for (s, n), tokens in zip(verifying, drafts.agreed(self.options.agree, kept, [n for _, n in verifying])):
            d, m = n - 1, len(tokens) - 1
            self.pacing.verified(s.drafting, m)  # what the model agreed with, whatever ends the sample
            if m < d:  # the step fed the rejected positions after what it keeps: they leave the cells
                self.bc.seq_rm(s.seq_id, s.cached - d + m)
            s.cached -= d - m
            accepted += drafts.record_kept(tokens, d, self.stats, lambda t, s=s: advance(s, t))
        return accepted

