"""Tokens drawn on the device and read a step later, so the host never waits with nothing queued.

Without it a step is: build the forward, evaluate it, copy the logits to the
host, draw the next token, build the next forward. The device idles while
the host builds, and the host idles while the device computes. Drawing a
greedy token on the device (`mx.argmax` of the same float32 logits the host
would take `np.argmax` of; both take the lowest id on a tie) lets the engine
feed that lazy token to the next forward and queue it (`mx.async_eval`)
before it reads the token. The host then builds step n+1 while the device
computes step n, as mlx-lm's `generate_step` does.

The rules the engines keep:

- Only a plain greedy sample of one process is drawn ahead: a sampled one draws
  from its own numpy generator (engines.sampling), a shaped one or one
  reporting logprobs is drawn on the host path (engines.shaping), and a tensor-parallel
  run agrees on each token through a collective (engines.records.Agree), so
  both stay on the host path, and so do their tokens.
- A token is drawn ahead only when the sample will still need a forward
  after it (it is not the last by max_tokens). When it turns out to end the
  sample (EOS, a stop string), the forward already queued behind it wrote
  one speculative position, which the engine removes again.
- Between steps, `settle` reads whatever is in flight. A state taken after
  it (`Engine.state()` settles first) is the one the host path would have.
"""

from __future__ import annotations

import time
from typing import Any

import attrs
import mlx.core as mx

from kvlayout.engines.records import Request, Sample, Sampling, Stats
from kvlayout.engines.shaping import on_host_only


@attrs.define(eq=False)
class Drawn:
    """The tokens one step drew on the device, `[R]`, in flight until first read.

    The host waits for that step's compute at the first read, a step later: the wait is
    that step's time, so it goes to `stats` split as that step fed (`prefill`, `decode`
    tokens), and `waited` tells the reading step to leave it out of its own.
    """

    tokens: mx.array
    stats: Stats
    prefill: int
    decode: int
    waited: float = 0.0
    _host: list[int] | None = None

    def read(self, i: int) -> int:
        """Token `i`, waiting for the step that draws it (once for all of them)."""
        if self._host is None:
            t0 = time.perf_counter()
            self._host = self.tokens.tolist()  # Python ints: ~1 us less than numpy's copy and scalar
            self.waited = time.perf_counter() - t0
            self.stats.add_time(self.waited, self.prefill, self.decode)
        return self._host[i]


def drawn_on_device(entry: Any, sample: Sample, pipeline: bool, sampling: Sampling) -> bool:
    """Whether `sample`'s next token is drawn on the device: its settings allow it (`plain_greedy`, asked
    once and kept on `entry.plain`) and the token will be fed back (`fed_back`). `entry`: an engine's
    record of the sequence (its `request`, `plain` and `drawn`, the token in flight if any)."""
    if entry.plain is None:
        entry.plain = plain_greedy(pipeline, sampling, entry.request, sample)
    return entry.plain and fed_back(entry.request, sample, entry.drawn is not None)


def plain_greedy(pipeline: bool, sampling: Sampling, request: Request, sample: Sample) -> bool:
    """Whether a sample's tokens may be drawn on the device, as far as its settings say (they hold for its
    whole life): the engine pipelines and the sample is greedy and plain (its own sampling, else the
    engine's: no shaping, no logprobs, engines.shaping). `drawn_on_device` keeps the answer per sample."""
    sampling = request.sampling or sampling
    return pipeline and sampling.temperature == 0.0 and not on_host_only(sampling, sample)


def fed_back(request: Request, sample: Sample, unread: bool) -> bool:
    """Whether the sample's next token will be fed back: it is not its last by max_tokens (`unread`: a token
    of it is in flight already)."""
    return len(sample.generated) + unread + 1 < request.max_tokens


def draw(logits: mx.array, stats: Stats, prefill: int, decode: int, rows: list[int] | None = None) -> Drawn:
    """The greedy tokens of `logits` `[R, V]` (of `rows` of it; all when None), queued at once, for
    a step that fed `prefill` and `decode` tokens (see Drawn)."""
    if rows is not None:
        logits = logits[mx.array(rows, dtype=mx.int32)]
    tokens = mx.argmax(logits.astype(mx.float32), axis=-1)  # [R]
    mx.async_eval(tokens)
    return Drawn(tokens, stats, prefill, decode)


def fed(pieces: list[tuple[Drawn, int] | list[int]]) -> list[int] | mx.array:
    """A step's input tokens from host ids and tokens drawn ahead, in order: a plain list when
    every one is known on the host, else one lazy uint32 array `[T]` (argmax's dtype)."""
    if pieces and not isinstance(pieces[0], list):
        d = pieces[0][0]
        if len(pieces) == d.tokens.size and all(p[0] is d and p[1] == i for i, p in enumerate(pieces)):
            return d.tokens  # every token of one draw, in order (a decode step's): as it is
    if all(isinstance(p, list) for p in pieces):
        return [t for p in pieces for t in p]
    parts: list[mx.array] = []
    run: tuple[Drawn, int, int] | None = None  # consecutive tokens of one step's draw: one slice

    def close_run() -> None:
        if run is not None:
            d, first, end = run
            # uint32 ids, as argmax gives them: no cast; all of them (a lone decode's): no slice either
            parts.append(d.tokens if first == 0 and end == d.tokens.size else d.tokens[first:end])

    for p in pieces:
        if isinstance(p, list):
            close_run()
            run = None
            if p:
                parts.append(mx.array(p, dtype=mx.uint32))  # one dtype with the drawn ones, to join them
        elif run is not None and run[0] is p[0] and run[2] == p[1]:
            run = (run[0], run[1], run[2] + 1)
        else:
            close_run()
            run = (p[0], p[1], p[1] + 1)
    close_run()
    return parts[0] if len(parts) == 1 else mx.concatenate(parts)
