"""The cell engine's state as plain JSON, and back: the scheduler's running sequences and queue.

`save` reads a Scheduler; `load` checks a saved state against the requests
and the cache and builds what the scheduler takes up, changing nothing when
it refuses (StateError naming the field by its path, read with
`engines.saved`).
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

from kvlayout.engines import saved
from kvlayout.engines.records import Request, Sample
from kvlayout.engines.scheduler import Running, Scheduler, Waiting
from kvlayout.errors import KVLayoutError
from kvlayout.faces import BatchControl

RUNNING_KEYS = ("seq_id", "request", "samples", "tokens", "admitted", "cached")


def save(scheduler: Scheduler) -> dict:
    """The running sequences (id, request, samples, tokens, admission, cached) and the queue."""
    return {
        "kind": "cell",
        "admissions": scheduler.admissions,
        "running": [
            {
                "seq_id": s.seq_id,
                "request": s.request.index,
                "samples": [x.index for x in s.samples],
                "tokens": list(s.tokens),
                "admitted": s.admitted,
                "cached": s.cached,
            }
            for s in scheduler.running
        ],
        "queue": [
            {"request": w.request.index, "samples": [x.index for x in w.samples], "tokens": list(w.tokens)}
            for w in scheduler.queue
        ],
    }


def load(scheduler: Scheduler, state: dict, requests: Sequence[Request]) -> None:
    """Put `state` (what `save` gave for `requests`) into `scheduler`, replacing what it holds.
    StateError, changing nothing, when `state` is another engine's, a value is of the wrong kind
    or out of range, a sequence's tokens are other than its request's prompt and sample's tokens,
    an unfinished sample is held nowhere or twice, or a running sequence holds another number of
    positions in the cache than it says."""
    if isinstance(state, dict) and state.get("kind", "cell") != "cell":
        raise saved.refuse("kind", f"saved by the {saved.name(state['kind'])} engine, resumed by another")
    state = saved.table(state, "", ("kind", "admissions", "running", "queue"))
    admissions = saved.integer(state["admissions"], "admissions", 0)
    held: dict[tuple[int, int], str] = {}  # (request, sample) -> where the state holds it
    running = _running(state["running"], admissions, requests, held, scheduler.bc)
    waiting = []
    for i, d in enumerate(saved.array(state["queue"], "queue")):
        where = f"queue[{i}]"
        d = saved.table(d, where, ("request", "samples", "tokens"))
        waiting.append(Waiting(*_unit(d, where, requests, held)))
    for r in requests:
        for s in r.samples:
            if s.finish_reason is None and (r.index, s.index) not in held:
                raise saved.refuse(
                    "queue", f"request {r.index}'s sample {s.index} is unfinished but neither running nor queued"
                )
    scheduler.running, scheduler.queue = running, collections.deque(waiting)
    scheduler.admissions = admissions


def _running(values, admissions: int, requests: Sequence[Request], held: dict, bc: BatchControl) -> list[Running]:
    """The saved running sequences, checked against the cache."""
    running, ids = [], set()
    for i, d in enumerate(saved.array(values, "running")):
        where = f"running[{i}]"
        d = saved.table(d, where, RUNNING_KEYS)
        r, samples, tokens = _unit(d, where, requests, held)
        seq_id = saved.integer(d["seq_id"], f"{where}.seq_id", 0)
        if seq_id in ids:
            raise saved.refuse(f"{where}.seq_id", f"sequence {seq_id} is running twice")
        ids.add(seq_id)
        admitted = saved.integer(d["admitted"], f"{where}.admitted", 0, admissions - 1)
        cached = saved.integer(d["cached"], f"{where}.cached", 0, len(tokens) - 1)
        try:
            in_cache = bc.next_pos(seq_id)
        except KVLayoutError:
            raise saved.refuse(f"{where}.seq_id", f"the cache holds no sequence {seq_id}") from None
        if in_cache != cached:
            raise saved.refuse(
                f"{where}.cached", f"sequence {seq_id} holds {in_cache} position(s) in the cache, the run says {cached}"
            )
        running.append(Running(seq_id, r, samples, tokens, admitted, cached))
    return running


def _unit(d: dict, where: str, requests: Sequence[Request], held: dict) -> tuple[Request, list[Sample], list[int]]:
    """A saved sequence's request, samples and tokens, checked; its samples noted in `held`."""
    r = requests[saved.integer(d["request"], f"{where}.request", 0, len(requests) - 1)]
    indices = saved.array(d["samples"], f"{where}.samples", minimum=1)
    samples = []
    for k, j in enumerate(indices):
        path = f"{where}.samples[{k}]"
        s = r.samples[saved.integer(j, path, 0, len(r.samples) - 1)]
        if s.finish_reason is not None:
            raise saved.refuse(
                path, f"request {r.index}'s sample {j} is finished ({s.finish_reason}); nothing of it runs"
            )
        if (r.index, j) in held:
            raise saved.refuse(path, f"request {r.index}'s sample {j} is also at {held[r.index, j]}")
        held[r.index, j] = where
        samples.append(s)
    # One sample: its prompt and what it generated; several (a prompt being prefilled): the prompt.
    expected = list(r.prompt) + (list(samples[0].generated) if len(samples) == 1 else [])
    if len(samples) > 1 and any(s.generated for s in samples):
        raise saved.refuse(f"{where}.samples", "a prompt still prefilling for several samples, one of which generated")
    if d["tokens"] != expected or any(type(t) is not int for t in d["tokens"]):
        raise saved.refuse(f"{where}.tokens", f"not request {r.index}'s prompt and its sample's tokens so far")
    return r, samples, expected
