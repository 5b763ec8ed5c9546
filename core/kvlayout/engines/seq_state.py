"""The seq engine's state as plain JSON, and back: which sample the cache holds, and how much of it.

A restored run continues that sample from the cache instead of recomputing
it; `load` checks the saved state against the requests and the cache,
refusing with StateError naming the field by its path (`engines.saved`).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvlayout.engines import saved
from kvlayout.engines.records import Request


def save(request: int | None = None, sample: int | None = None, cached: int = 0) -> dict:
    """The state naming `request`'s sample `sample` with `cached` tokens in the cache (None: no sample)."""
    current = None if request is None else [request, sample]
    return {"kind": "seq", "current": current, "cached": cached}


def load(state: dict, requests: Sequence[Request], length: int) -> tuple[int, int, int] | None:
    """(request, sample, cached) of the sample the cache holds (`length` tokens), None when it holds
    none. StateError when `state` is another engine's, a value of the wrong kind or out of range,
    a sample named that is finished or not the next to run, or a cache holding another number of
    its tokens."""
    if isinstance(state, dict) and state.get("kind", "seq") != "seq":
        raise saved.refuse("kind", f"saved by the {saved.name(state['kind'])} engine, resumed by another")
    state = saved.table(state, "", ("kind", "current", "cached"))
    if state["current"] is None:
        saved.integer(state["cached"], "cached", 0, 0)
        return None
    current = saved.array(state["current"], "current", length=2)
    r = requests[saved.integer(current[0], "current[0]", 0, len(requests) - 1)]
    s = r.samples[saved.integer(current[1], "current[1]", 0, len(r.samples) - 1)]
    # The samples run in order: the one in the cache is the first unfinished one.
    first = next(((q, x) for q in requests for x in q.samples if x.finish_reason is None), None)
    if first is None or (first[0].index, first[1].index) != (r.index, s.index):
        raise saved.refuse("current", f"request {r.index}'s sample {s.index} is not the next unfinished sample")
    cached = saved.integer(state["cached"], "cached", 0, len(r.prompt) + len(s.generated) - 1)
    if length != cached:
        raise saved.refuse("cached", f"the cache holds {length} token(s), the run says {cached}")
    return r.index, s.index, cached
