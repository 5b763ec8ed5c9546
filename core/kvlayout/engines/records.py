"""The records an engine keeps: requests and their samples, sampling settings, step statistics.

A sample owns its random generator, so what it generates never depends on
which sequences shared its steps. The engines (engines.seq, engines.cell)
fill these; the runner turns them into its results (runner.records).

Two seams reach a caller while a sample is generated, both without the
engine knowing what is behind them: a sample's `stopper` (its own stop
condition, e.g. the runner's stop strings, asked about every token it keeps)
and the engine's `on_token` callback (every change to a sample, as it
happens: what streaming output and a server listen to).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import attrs
import numpy as np

from kvlayout.engines.sampling import sample_rng

# Called as tokens get done: advance by this many tokens of the planned total.
OnProgress = Callable[[int], None]


class Stopper(Protocol):
    """A sample's own stop condition, beyond EOS and max_tokens.

    Called with each token the sample keeps, in order and once each (a
    preempted sample's recomputed tokens are not sampled again, so not fed
    again); True ends the sample there with finish_reason "stop", the token
    kept. It sees only ids: what it decodes them to is its own business.
    """

    def __call__(self, token: int) -> bool: ...


@attrs.frozen
class Sampling:
    """How tokens are drawn. `logit_bias`: (id, amount) pairs added to the logits;
    `presence_penalty` / `frequency_penalty`: subtracted once for every id a sample generated, and
    once per time it did (OpenAI's rule); `logprobs`: report each kept token's logprob with that
    many alternatives (0-20), None for none (engines.shaping)."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    logprobs: int | None = None


@attrs.define
class Sample:
    """One sample of a request: what it generated and why it stopped."""

    request: int
    index: int
    rng: np.random.Generator = attrs.field(repr=False)
    generated: list[int] = attrs.field(factory=list)
    # "stop", "length", "error" (a forward failed twice) or "cancelled" (Engine.cancel)
    finish_reason: str | None = None
    error: str | None = None  # the failure's message when finish_reason is "error"
    stopper: Stopper | None = attrs.field(default=None, repr=False, eq=False)  # None: EOS and length only
    # What it may generate next (a grammar: engines.shaping.Constraint), told every token it keeps; None: anything.
    constraint: Any = attrs.field(default=None, repr=False, eq=False)
    # One engines.shaping.TokenLogprob per generated token, when its request's sampling asks for logprobs.
    logprobs: list = attrs.field(factory=list, repr=False)


@attrs.define
class Request:
    """A request as the engines see it: prompt ids, limits, and its samples in order.

    `sampling`: the request's own settings (a server's client sends them), in place of the
    engine's; None: the engine's. `cached_tokens`: prompt tokens an engine found in a prefix
    cache and did not prefill (engines.prefixes; 0 without one). `started`: an engine began one
    of its samples (admitted it), so it no longer waits in the engine's queue (a server counts it
    running from then). `isolation`: the prefix cache shares cells only between requests with
    the same key (a server's tenant; "" for everyone, engines.prefixes).
    """

    index: int
    prompt: list[int]
    max_tokens: int
    n: int
    samples: list[Sample] = attrs.field(factory=list)
    sampling: Sampling | None = None
    cached_tokens: int = 0
    started: bool = False
    isolation: str = ""  # prefix-cache tenant: only requests with the same key share kept prefixes
    # Score the prompt (a legacy completion's echo with logprobs): None, not asked; else the alternatives
    # per token. `prompt_logprobs` then holds, per prompt position, its token's TokenLogprob given what
    # precedes it (None for the first, which nothing precedes); the prompt is prefilled, never reused.
    score_prompt: int | None = None
    prompt_logprobs: list = attrs.field(factory=list, repr=False)


@attrs.define
class Stats:
    """What a run measured. Step time is split between prefill and decode by fed tokens."""

    layout: str = ""
    kv_dtype: str = ""
    model: str = ""
    steps: int = 0
    prefill_tokens: int = 0  # prompt (and recomputed) tokens fed
    decode_tokens: int = 0  # sampled tokens fed back
    generated_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    wall_s: float = 0.0
    peak_cells: int = 0  # cells the cache held at once
    # Cells the cache's sliding-window layers held at once, where they keep tables of their own
    # (BatchControl.cells_by_window; the largest window table's): 0 for none.
    peak_window_cells: int = 0
    # Tokens the live sequences held at once, each counting its whole history
    # (shared prefix included): what private copies would need.
    peak_tokens: int = 0
    preemptions: int = 0
    max_batch: int = 0  # most sequences in one step
    failed_forwards: int = 0  # forwards that raised and were aborted (abort_step), retried or not
    # Speculation (engines.drafts): draft tokens the steps verified, and how many of them were kept.
    drafted_tokens: int = 0
    accepted_tokens: int = 0

    @property
    def prefill_tok_s(self) -> float:
        return self.prefill_tokens / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tok_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s else 0.0

    def to_json(self) -> dict:
        out = attrs.asdict(self)
        out["prefill_tok_s"] = self.prefill_tok_s
        out["decode_tok_s"] = self.decode_tok_s
        return out

    def account(self, seconds: float, prefill: int, decode: int) -> None:
        self.steps += 1
        self.prefill_tokens += prefill
        self.decode_tokens += decode
        self.add_time(seconds, prefill, decode)

    def add_time(self, seconds: float, prefill: int, decode: int) -> None:
        """Seconds of a step already counted, split as it fed: the host's wait for what it drew on
        the device, read a step later (engines.ahead)."""
        fed = prefill + decode
        if fed:
            self.prefill_s += seconds * prefill / fed
            self.decode_s += seconds * decode / fed

    def note_held(self, cells: int, tokens: int, batch: int, window_cells: int = 0) -> None:
        """After a step: cells the cache holds (its sliding-window layers' tables: `window_cells`),
        tokens the live sequences hold, sequences it carried."""
        self.peak_cells = max(self.peak_cells, cells)
        self.peak_window_cells = max(self.peak_window_cells, window_cells)
        self.peak_tokens = max(self.peak_tokens, tokens)
        self.max_batch = max(self.max_batch, batch)


# Called whenever a sample changes, as it happens: after a sampled token is recorded
# (`token`; an EOS that ended the sample is not kept in `sample.generated`), or when the
# sample ends without one (a forward failed twice: token None, finish_reason "error").
# `sample.finish_reason` is set when that change finished it.
OnToken = Callable[[Request, Sample, int | None], None]


def ignore_tokens(request: Request, sample: Sample, token: int | None) -> None:
    """The OnToken of an engine nobody listens to."""




def make_requests(
    prompts: Sequence[Sequence[int]], max_tokens: Sequence[int], ns: Sequence[int], seed: int
) -> list[Request]:
    reqs = []
    for i, (prompt, mt, n) in enumerate(zip(prompts, max_tokens, ns)):
        r = Request(i, list(prompt), mt, n)
        r.samples = [Sample(i, j, sample_rng(seed, i, j)) for j in range(n)]
        reqs.append(r)
    return reqs


def take_token(sample: Sample, token: int, request: Request, eos: frozenset[int], logprob: Any = None) -> bool:
    """Record a sampled token (with its `logprob` record, when it reports them); True when the sample
    is finished: on EOS (not kept), when its stopper says so (the token kept; "stop" wins over
    "length" on the last token), or at max_tokens. Its constraint hears every token it keeps."""
    if token in eos:
        sample.finish_reason = "stop"
        return True
    sample.generated.append(token)
    if logprob is not None:
        sample.logprobs.append(logprob)
    if sample.constraint is not None:
        sample.constraint.accept(token)
    if sample.stopper is not None and sample.stopper(token):
        sample.finish_reason = "stop"
        return True
    if len(sample.generated) >= request.max_tokens:
        sample.finish_reason = "length"
        return True
    return False


def unplanned(sample: Sample, request: Request) -> int:
    """Planned tokens a finished sample will never generate (for the progress total)."""
    return request.max_tokens - len(sample.generated)


def end_sample(request: Request, sample: Sample, reason: str, on_token: OnToken, progress: OnProgress,
               error: str | None = None) -> None:
    """End `sample` with no token ("error" with its message, or "cancelled"): `on_token` hears it,
    and progress settles the tokens it will never generate. One way for every engine."""
    sample.finish_reason, sample.error = reason, error
    on_token(request, sample, None)
    progress(unplanned(sample, request))


def record_token(sample: Sample, token: int, request: Request, eos, stats: Stats, logprob: Any = None
                 ) -> tuple[bool, int]:
    """Record `token` (and its `logprob` record) as `sample`'s next: (finished, how far progress moves).

    A token counts as generated unless it is the EOS that stopped the sample; a finished sample
    also settles the planned tokens it will never generate.
    """
    finished = take_token(sample, token, request, eos, logprob)
    if token not in eos:
        stats.generated_tokens += 1
    return finished, 1 + (unplanned(sample, request) if finished else 0)


# How the tokens a step drew become the step's tokens (one call per step, the tokens in the order
# drawn): as they are, or, tensor-parallel, as rank 0 drew them, reaching every rank through a
# collective (kvlayout.distributed), so every rank's engine records the same tokens.
Agree = Callable[[list[int]], list[int]]


def same_tokens(tokens: list[int]) -> list[int]:
    """The Agree of one process: the tokens as drawn."""
    return tokens
