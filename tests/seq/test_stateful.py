"""The seq layout, model-checked: random steps, rewinds and clears against a plain list.

The model is the list of tokens the sequence holds: a step at `start` replaces
everything from `start` on. Query position p sees key position q iff `q <= p`
and, on a ring layer of window w, `q > p - w`. What a ring can still serve is
modelled naively too: each ring is a dict from slot to the position last
written there, over the `window + max_write - 1` slots docs/design.md gives it; a
position is lost once a newer one takes its slot, and a step (or a rewind)
may start at L only if no ring lost a position in `[L - w + 1, L)`.

Rules: steps of 1..max_step tokens at or below the length (every layer, in a
random order), refused steps (a gap, older than a ring holds, empty, longer
than max_write, past capacity), rewinds within and beyond the floor, and
clear. A step may pause between two layers for calls a forward in progress
refuses (a rewind past its start, a step starting past it), which must
change nothing before the remaining layers serve it. Every layer of every step must return keys and values that, in
logical order, are exactly the model's visible tokens, under a mask equal to
the model's band; after every rule the length, can_extend and the floor
agree. Each token's K is its id (V its negation), so a key out of place shows.

Example counts come from the hypothesis profile (tests/conftest.py).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvlayout import KVLayoutError, MaskKind, StepError
from tests.seq.support import D, H, assert_same, make_cache, snapshot


def effective_mask(spec, T: int, S: int) -> np.ndarray:
    """The bool [T, S] mask attention will apply for this spec."""
    if spec.mask_kind is MaskKind.NONE:
        return np.ones((T, S), bool)
    if spec.mask_kind is MaskKind.CAUSAL:  # lower-right aligned, as MLX applies it
        return np.arange(S)[None, :] <= np.arange(T)[:, None] + S - T
    return np.array(spec.mask).reshape(T, S)


class NaiveSequence:
    def __init__(self, windows, capacity, max_write):
        self.windows, self.capacity = windows, capacity
        rings = sorted({w for w in windows if w})
        # one step goes to every layer, so the tightest ring bounds it
        self.max_step = min([max_write or w for w in rings] + [capacity])
        self.slots = {w: w + (max_write or w) - 1 for w in rings}
        self.clear()

    def clear(self):
        self.tokens: list[int] = []
        self.held = {w: {} for w in self.slots}  # ring -> slot -> position last written there
        self.lost = {w: None for w in self.slots}  # ring -> newest position a newer one overwrote

    def can_start_at(self, L: int) -> bool:
        """Whether every ring still holds the window a step at L needs."""
        return L <= len(self.tokens) and all(
            lost is None or lost < L - w + 1 for w, lost in self.lost.items()
        )

    def floor(self) -> int:
        return min(L for L in range(len(self.tokens) + 1) if self.can_start_at(L))

    def step(self, start: int, ids: list[int]) -> None:
        del self.tokens[start:]
        self.tokens.extend(ids)
        for w, slots in self.held.items():
            for p in range(start, start + len(ids)):
                old = slots.get(p % self.slots[w])
                if old is not None and old < p:
                    self.lost[w] = max(old, self.lost[w] if self.lost[w] is not None else -1)
                slots[p % self.slots[w]] = p

    def visible(self, start: int, T: int, w: int) -> tuple[int, np.ndarray]:
        """The first position a layer of window w reads, and the [T, S] band from it."""
        first = 0 if w == 0 else max(0, start - w + 1)
        p = np.arange(start, start + T)[:, None]
        q = np.arange(first, start + T)[None, :]
        return first, (q <= p) & ((q > p - w) if w else True)


class SeqCacheMachine(RuleBasedStateMachine):
    @initialize(
        windows=st.lists(st.sampled_from([0, 0, 1, 2, 3, 4, 5]), min_size=1, max_size=4),
        capacity=st.integers(4, 28),
        max_write=st.none() | st.integers(1, 4),
        initial=st.integers(0, 4),
    )
    def setup(self, windows, capacity, max_write, initial):
        self.cache = make_cache(windows=windows, capacity=capacity, max_write=max_write, initial_capacity=initial)
        self.m = NaiveSequence(windows, capacity, max_write)
        self.next_id = 1

    def kv(self, ids):
        k = np.broadcast_to(np.array(ids, np.float32)[None, None, :, None], (1, H, len(ids), D))
        return mx.array(k), mx.array(-k)

    def run_step(self, data, start: int, T: int, pause: int | None = None):
        """Feed T new tokens from `start` to every layer, in a random order, and check each answer;
        after `pause` layers, make calls the half-written step refuses."""
        ids = list(range(self.next_id, self.next_id + T))
        self.next_id += T
        self.m.step(start, ids)
        k, v = self.kv(ids)
        for i, layer in enumerate(data.draw(st.permutations(range(len(self.m.windows))), label="layer order")):
            if i == pause:
                self.refuse_mid_forward(data, start)
            spec = self.cache.update_and_fetch(layer, list(range(start, start + T)), k, v)
            first, band = self.m.visible(start, T, self.m.windows[layer])
            want, _ = self.kv(self.m.tokens[first : start + T])  # the keys, oldest first
            np.testing.assert_array_equal(np.array(spec.keys), np.array(want))
            np.testing.assert_array_equal(np.array(spec.values), -np.array(want))
            np.testing.assert_array_equal(effective_mask(spec, T, band.shape[1]), band)

    def refuse_mid_forward(self, data, start: int):
        """Some layers wrote the step at `start`, the others not yet: a rewind that keeps part of it,
        and a step starting past it, are refused (StepError) and change nothing."""
        n = len(self.m.tokens)
        assert self.cache.book.open_step()[0] == start
        before = snapshot(self.cache)
        if n > start:
            new_len = data.draw(st.integers(start + 1, n + 1), label="rewind mid-forward")
            with pytest.raises(StepError, match="during a forward"):
                self.cache.as_control().rewind(new_len)
        if n < self.m.capacity:
            layer = data.draw(st.integers(0, len(self.m.windows) - 1), label="layer of a step past it")
            k, v = self.kv([0])
            with pytest.raises(StepError, match="past the step at"):
                self.cache.update_and_fetch(layer, [data.draw(st.integers(start + 1, n), label="start past it")], k, v)
        assert_same(snapshot(self.cache), before)

    @rule(data=st.data())
    def step(self, data):
        """A step at the length (decode / next chunk) or below it (redo), of 1..max_step tokens;
        now and then paused between two layers."""
        n, m = len(self.m.tokens), self.m
        starts = [L for L in range(m.floor(), n + 1) if L < m.capacity]
        if not starts:
            return  # full, and the rings hold too little to go back: only rewind/clear can help
        start = data.draw(st.sampled_from(starts[-1:] * 3 + starts), label="start")  # mostly appends
        T = data.draw(st.integers(1, min(m.max_step, m.capacity - start)), label="T")
        layers = len(m.windows)
        pause = data.draw(st.none() | st.integers(1, layers - 1), label="pause after") if layers > 1 else None
        self.run_step(data, start, T, pause)

    @rule(data=st.data())
    def refuse_a_step(self, data):
        n, m = len(self.m.tokens), self.m
        kinds = ["gap", "empty", "past capacity"]
        if m.floor() > 0:
            kinds.append("older than a ring holds")
        if m.max_step < m.capacity:
            kinds.append("longer than max_write")
        kind = data.draw(st.sampled_from(kinds), label="kind")
        if kind == "gap":
            start, T = n + data.draw(st.integers(1, 3)), 1
        elif kind == "empty":
            start, T = n, 0
        elif kind == "past capacity":
            start = data.draw(st.integers(max(0, m.capacity - m.max_step + 1), m.capacity), label="start")
            T = m.capacity - start + 1
        elif kind == "older than a ring holds":
            start, T = data.draw(st.integers(0, m.floor() - 1), label="start"), 1
        else:
            start, T = n, m.max_step + 1
        layer = data.draw(st.integers(0, len(m.windows) - 1), label="layer")
        k, v = self.kv(list(range(T)))
        before = snapshot(self.cache)
        with pytest.raises(KVLayoutError):
            self.cache.update_and_fetch(layer, list(range(start, start + T)), k, v)
        assert_same(snapshot(self.cache), before)

    @rule(data=st.data())
    def rewind(self, data):
        n = len(self.m.tokens)
        new_len = data.draw(st.integers(0, n + 2), label="new_len")
        ok = new_len == 0 or self.m.can_start_at(new_len)  # back to empty needs nothing a ring lost
        before = snapshot(self.cache)
        assert self.cache.as_control().rewind(new_len) is ok
        if new_len == 0:
            self.m.clear()
        elif ok:
            del self.m.tokens[new_len:]
        else:
            assert_same(snapshot(self.cache), before)

    @rule()
    def clear(self):
        self.cache.as_control().clear()
        self.m.clear()

    @invariant()
    def the_cache_agrees_with_the_model(self):
        n, room = len(self.m.tokens), self.m.capacity - len(self.m.tokens)
        assert self.cache.as_control().length == n
        assert self.cache.as_control().can_extend(room) and not self.cache.as_control().can_extend(room + 1)
        assert self.cache.book.floor == self.m.floor()
        # rings only: it may exceed capacity
        assert min(self.cache.as_control().max_step, self.m.capacity) == self.m.max_step


# Half the suite's default examples: the seq layout's bookkeeping is small, and this machine was
# the suite's slowest test (~8 s at 200).
TestSeqCache = SeqCacheMachine.TestCase
TestSeqCache.settings = settings(parent=TestSeqCache.settings, max_examples=100)
