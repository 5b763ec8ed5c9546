"""Generation through a seq layout: one sequence at a time (SequenceControl face)."""

from __future__ import annotations

import time

from kvlayout.errors import CapacityError
from kvlayout.engines.records import Progress, Request, Sample, Sampling, Stats, sample_next, unplanned
from kvlayout.engines.recovery import ForwardFailed, Interrupted, guarded_forward


class SeqEngine:
    """One sequence at a time through a SequenceControl cache.

    Every sample regenerates from its prompt: the cache is cleared before each.
    A step writes at most `chunk` tokens (a ring layer takes at most its window
    per step unless the config sets max_write).

    A forward that raises is aborted in the cache (`abort_step`) and retried
    once; failing again, the sample finishes with finish_reason "error" and
    the next one runs (see engines.recovery).

    `current` (request, sample) and `cached` name the sample the cache holds
    and how many of its tokens are in it, so a stopped run can resume it.
    """

    def __init__(self, model, cache, control, eos, sampling: Sampling, chunk: int, stats: Stats, progress: Progress):
        self.model, self.cache, self.control = model, cache, control
        self.eos, self.sampling, self.chunk = eos, sampling, chunk
        self.stats, self.progress = stats, progress
        self.current: tuple[int, int] | None = None
        self.cached = 0

    def run(self, requests: list[Request], stop=None) -> bool:
        """Generate every unfinished sample; False when `stop()`, asked before every step,
        ended the run early (between two steps: the state can be saved and resumed)."""
        for r in requests:
            for s in r.samples:
                if s.finish_reason is None and not self._generate(r, s, stop):
                    return False
        return True

    def _realign(self, cached: int) -> None:
        """After a failed forward the cache holds `cached` tokens of the sample.

        abort_step saw to it unless every layer had written the step (the
        failure came later, e.g. in the LM head): that step is complete and
        not aborted, so the length is rewound to `cached` (never below the
        floor: a step ends at most max_write past its start).
        """
        if self.control.length > cached:
            self.control.rewind(cached)

    def _generate(self, r: Request, s: Sample, stop=None) -> bool:
        if self.current == (r.index, s.index):
            cached = self.cached  # resuming: the cache holds this sample's first `cached` tokens
        else:
            self.control.clear()
            cached = 0
        self.current, self.cached = (r.index, s.index), cached
        tokens = list(r.prompt) + list(s.generated)
        retried = False
        while True:
            if stop is not None and stop():
                return False
            k = min(len(tokens) - cached, self.chunk)
            if not self.control.can_extend(k):
                raise CapacityError(
                    f"the seq cache cannot take {k} more token(s) at length {self.control.length}"
                )
            t0 = time.perf_counter()
            positions = range(cached, cached + k)
            done = cached + k == len(tokens)
            # One row even mid-prompt: evaluating it forces this step's cache writes.
            try:
                row = guarded_forward(self.model, self.cache, tokens[cached : cached + k], positions, [k - 1])
            except Interrupted:
                self._realign(cached)
                raise
            except ForwardFailed as exc:  # aborted: the cache is back at `cached`
                self._realign(cached)
                self.stats.failed_forwards += 1
                if not retried:
                    retried = True
                    continue
                s.finish_reason, s.error = "error", str(exc)
                self.progress(unplanned(s, r))
                return True
            retried = False
            decode = 1 if (k == 1 and len(tokens) > len(r.prompt)) else 0
            cached += k
            self.cached = cached
            finished = False
            if done:
                token, finished, moved = sample_next(s, row[0], r, self.sampling, self.eos, self.stats)
                if not finished:
                    tokens.append(token)
            self.stats.account(time.perf_counter() - t0, k - decode, decode)
            self.stats.note_held(self.control.length, self.control.length, 1)
            if done:
                self.progress(moved)
            if finished:
                return True
