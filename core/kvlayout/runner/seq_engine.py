"""Generation through a seq layout: one sequence at a time (SequenceControl face)."""

from __future__ import annotations

import time

import mlx.core as mx
import numpy as np

from kvlayout.errors import CapacityError
from kvlayout.runner.records import Progress, Request, Sample, Sampling, Stats, take_token, unplanned
from kvlayout.runner.sampling import sample_token


class SeqEngine:
    """One sequence at a time through a SequenceControl cache.

    Every sample regenerates from its prompt: the cache is cleared before each.
    A step writes at most `chunk` tokens (a ring layer takes at most its window
    per step unless the config sets max_write).
    """

    def __init__(self, model, cache, control, eos, sampling: Sampling, chunk: int, stats: Stats, progress: Progress):
        self.model, self.cache, self.control = model, cache, control
        self.eos, self.sampling, self.chunk = eos, sampling, chunk
        self.stats, self.progress = stats, progress

    def run(self, requests: list[Request]) -> None:
        for r in requests:
            for s in r.samples:
                self._generate(r, s)

    def _generate(self, r: Request, s: Sample) -> None:
        self.control.clear()
        tokens = list(r.prompt)
        cached = 0
        while True:
            k = min(len(tokens) - cached, self.chunk)
            if not self.control.can_extend(k):
                raise CapacityError(
                    f"the seq cache cannot take {k} more token(s) at length {self.control.length}"
                )
            t0 = time.perf_counter()
            positions = range(cached, cached + k)
            done = cached + k == len(tokens)
            # One row even mid-prompt: evaluating it forces this step's cache writes.
            logits = self.model(tokens[cached : cached + k], positions, self.cache, rows=[k - 1])
            row = np.array(logits.astype(mx.float32))  # the sync point of the step
            decode = 1 if (k == 1 and len(tokens) > len(r.prompt)) else 0
            cached += k
            finished = False
            if done:
                token = sample_token(row[0], self.sampling.temperature, self.sampling.top_p, s.rng)
                finished = take_token(s, token, r, self.eos)
                if not finished:
                    tokens.append(token)
            self.stats.account(time.perf_counter() - t0, k - decode, decode)
            self.stats.max_batch = max(self.stats.max_batch, 1)
            held = self.control.length
            self.stats.peak_cells = max(self.stats.peak_cells, held)
            self.stats.peak_tokens = max(self.stats.peak_tokens, held)
            if done:
                self.stats.generated_tokens += 1 if not (finished and s.finish_reason == "stop") else 0
                self.progress(1 + (unplanned(s, r) if finished else 0))
            if finished:
                return
