"""`kvlayout serve` over several ranks: rank 0 serves HTTP, every other rank replays its engine.

Rank 0's worker drives its engine as in one process, through `Leading`: a
proxy that notes each `add` and `cancel` and, before each `step`, hands
the notes to the other ranks as one message (`World.json_from_leader`, a
collective). Each other rank runs `follow`: the same engine over its own
shard and cache, applying each message in order (the same requests, rebuilt
with the same generators and stop strings, the same cancellations, then the
step). From the same inputs the engines decide the same admissions, cells
and preemptions everywhere; the tokens themselves come from rank 0 inside
each step (the engines' Agree). While rank 0 is idle it sends a heartbeat
every HEARTBEAT_S, so a follower's wait never looks like a lost rank; its
last message tells the followers to stop.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvlayout.distributed import World
from kvlayout.engines.records import Request, Sample, Sampling, Stats
from kvlayout.errors import RunEnded
from kvlayout.runner.text import SampleText

HEARTBEAT_S = 1.0
WHAT = "rank 0's next step (the server's requests)"


def request_record(request: Request) -> dict:
    """What a follower needs to rebuild `request` as rank 0 added it (JSON)."""
    s = request.sampling
    return {
        "index": request.index,
        "prompt": list(request.prompt),
        "max_tokens": request.max_tokens,
        "n": request.n,
        "sampling": None if s is None else [s.temperature, s.top_p, s.seed],
        "rngs": [sample.rng.bit_generator.state for sample in request.samples],
        "stop": [list(getattr(sample.stopper, "stop", ())) for sample in request.samples],
        "isolation": request.isolation,  # the followers' prefix caches must share exactly as rank 0's does
        # A scored prompt's forwards read every prompt row (Request.score_prompt): every rank's must be the same.
        "score_prompt": request.score_prompt,
    }


def rebuild_request(record: dict, decode: Callable) -> Request:
    """The Request `request_record` describes, each sample's generator in the state rank 0's was in."""
    samples = []
    for j, (state, stop) in enumerate(zip(record["rngs"], record["stop"])):
        rng = np.random.default_rng()
        rng.bit_generator.state = state
        sample = Sample(record["index"], j, rng)
        sample.stopper = SampleText(decode, stop)
        samples.append(sample)
    sampling = None if record["sampling"] is None else Sampling(*record["sampling"])
    return Request(record["index"], record["prompt"], record["max_tokens"], record["n"], samples, sampling=sampling,
                   isolation=record["isolation"], score_prompt=record["score_prompt"])


class Leading:
    """Rank 0's engine, noting what the worker does to it and telling the other ranks before each step.

    `fresh`: this engine replaces one after a step that raised (the cache was cleared): the
    followers clear theirs and start a fresh engine too."""

    def __init__(self, engine: Any, world: World, fresh: bool = False):
        self.engine, self.world = engine, world
        self.notes: list[list] = [["reset"]] if fresh else []
        self.added: set[int] = set()  # requests this engine was given: only their cancels are news
        self.sent_at = time.monotonic()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def add(self, requests: list[Request]) -> None:
        self.notes += [["add", request_record(r)] for r in requests]
        self.added.update(r.index for r in requests)
        self.engine.add(requests)

    def cancel(self, request: Request) -> None:
        if request.index in self.added:  # a ticket still queued at shutdown never reached the engine
            self.notes.append(["cancel", request.index])
        self.engine.cancel(request)

    def step(self) -> bool:
        self.send(["step"])
        return self.engine.step()

    def idle(self) -> None:
        """Between steps with nothing to run: a heartbeat (and any notes) now and then."""
        if self.notes or time.monotonic() - self.sent_at >= HEARTBEAT_S:
            self.send([])

    def finish(self) -> None:
        """The server stops: the last notes, then the followers stop."""
        self.send(["stop"])

    def send(self, last: list) -> None:
        notes, self.notes = self.notes + ([last] if last else []), []
        self.world.json_from_leader(notes, WHAT)
        self.sent_at = time.monotonic()


def follow(world: World, make_engine: Callable[[Stats], Any], clear: Callable[[], None], decode: Callable) -> None:
    """Replay rank 0's engine on this rank until it says stop (see the module).

    A step that raises here raised on rank 0 too (the same engine, the same inputs; a forward's
    failure is a RunEnded and ends the run instead): rank 0's worker then clears its cache and
    starts a fresh engine, which its next message says ("reset"); until then this rank waits."""
    engine = make_engine(Stats())
    requests: dict[int, Request] = {}
    while True:
        for note in world.json_from_leader(None, WHAT):
            verb = note[0]
            if verb == "add":
                request = rebuild_request(note[1], decode)
                requests[request.index] = request
                engine.add([request])
            elif verb == "cancel":
                if note[1] in requests:  # one already finished here is finished on rank 0: nothing to end
                    engine.cancel(requests[note[1]])
            elif verb == "reset":
                clear()
                requests.clear()
                engine = make_engine(Stats())
            elif verb == "step":
                try:
                    engine.step()
                except RunEnded:
                    raise
                except Exception:  # noqa: BLE001 - as Worker.step: rank 0 recovers and says "reset"
                    pass
            elif verb == "stop":
                return
        done = [i for i, r in requests.items() if all(s.finish_reason is not None for s in r.samples)]
        for i in done:
            del requests[i]
