"""abort_step on the seq layout: the length (and the ring records) return to where the step began."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kvlayout.errors import StepError
from kvlayout.faces import StepAbort
from kvlayout.mlx import attend
from kvlayout_seq.bookkeeping import SeqBook
from tests.seq.support import forward, kv, make_cache, step


def book_state(cache) -> tuple:
    return cache.as_control().length, cache.book.floor, [getattr(p, "retained", None) for p in cache.book.policies]


def test_the_seq_cache_implements_the_step_abort_face():
    assert isinstance(make_cache(), StepAbort)


def test_an_appending_step_aborted_after_one_layer_returns_everything_on_flat_layers():
    cache = make_cache(windows=(0, 0, 0))
    k, v = kv(10)
    forward(cache, 0, k[:, :, :6], v[:, :, :6])
    before = book_state(cache)
    step(cache, 6, k[:, :, 6:9], v[:, :, 6:9], layer=0)  # layers 1 and 2 never run
    assert cache.as_control().length == 9
    assert cache.abort_step() is True
    assert book_state(cache) == before
    assert cache.abort_step() is False


def test_a_ring_none_of_whose_layers_ran_gets_its_record_back():
    # Layer 0 flat, layer 1 a ring of window 4 (max_write 4: 7 slots).
    cache = make_cache(windows=(0, 4), capacity=64)
    k, v = kv(20)
    forward(cache, 0, k[:, :, :12], v[:, :, :12], chunk=4)
    before = book_state(cache)
    step(cache, 12, k[:, :, 12:16], v[:, :, 12:16], layer=0)  # commits: the ring records the reuse
    assert cache.book.policies[1].retained > before[2][1]
    assert cache.abort_step()
    assert book_state(cache) == before  # the ring was never written: its floor comes back too


def test_a_ring_that_was_written_keeps_its_record_and_the_floor_stays_at_or_below_the_start():
    cache = make_cache(windows=(4, 0), capacity=64)
    k, v = kv(20)
    forward(cache, 0, k[:, :, :12], v[:, :, :12], chunk=4)
    length, floor, _ = book_state(cache)
    step(cache, 12, k[:, :, 12:16], v[:, :, 12:16], layer=0)  # the ring layer ran, overwrote 5..8
    retained = cache.book.policies[0].retained
    assert cache.abort_step()
    assert cache.as_control().length == length == 12
    assert cache.book.policies[0].retained == retained  # what the ring overwrote stays unreachable
    assert floor <= cache.book.floor <= cache.as_control().length
    assert cache.as_control().rewind(cache.book.floor - 1) is False  # below what the written ring still holds


def test_a_step_that_overwrote_below_the_length_keeps_only_what_lies_before_it():
    cache = make_cache(windows=(0, 0))
    k, v = kv(10)
    forward(cache, 0, k[:, :, :8], v[:, :, :8])
    step(cache, 5, k[:, :, 5:7], v[:, :, 5:7], layer=0)  # overwrites 5, 6 in layer 0 only
    assert cache.abort_step()
    assert cache.as_control().length == 5  # positions 5..7 are no longer whole in every layer


def test_rewind_and_clear_end_the_step():
    cache = make_cache(windows=(0, 0))
    k, v = kv(6)
    forward(cache, 0, k[:, :, :4], v[:, :, :4])
    assert cache.as_control().rewind(3)
    assert cache.abort_step() is False and cache.as_control().length == 3
    forward(cache, 3, k[:, :, 3:5], v[:, :, 3:5])
    cache.as_control().clear()
    assert cache.abort_step() is False and cache.as_control().length == 0


def test_a_rewind_that_would_keep_part_of_a_half_written_step_is_refused_and_leaves_it_open():
    cache = make_cache(windows=(0, 0))
    k, v = kv(6)
    forward(cache, 0, k[:, :, :2], v[:, :, :2])
    step(cache, 2, k[:, :, 2:4], v[:, :, 2:4], layer=0)  # layer 1 has not written 2..3
    for new_len in (3, 4, 5):
        with pytest.raises(StepError, match=rf"rewind\(new_len={new_len}\) during a forward: layer\(s\) \[1\]"):
            cache.as_control().rewind(new_len)
    assert cache.as_control().length == 4 and cache.book.open_step() == (2, [1])
    assert cache.as_control().rewind(2) and cache.as_control().length == 2  # to its start: nothing of it is kept
    assert cache.abort_step() is False


def test_a_step_past_a_half_written_one_is_refused_and_the_forward_goes_on():
    # The seq layout's verb in the middle of a forward: the next step begun while layer 1 has not
    # written this one would leave position 2 unwritten there, read as zeros ever after.
    cache = make_cache(windows=(0, 0))
    k, v = kv(6)
    forward(cache, 0, k[:, :, :2], v[:, :, :2])
    step(cache, 2, k[:, :, 2:3], v[:, :, 2:3], layer=0)
    for layer in (0, 1):
        with pytest.raises(
            StepError, match=r"positions start at 3, past the step at 2 that layer\(s\) \[1\] have not written"
        ):
            step(cache, 3, k[:, :, 3:4], v[:, :, 3:4], layer=layer)
    assert cache.as_control().length == 3 and cache.book.open_step() == (2, [1])
    spec = step(cache, 2, k[:, :, 2:3], v[:, :, 2:3], layer=1)  # layer 1 serves the open step after all
    assert cache.book.open_step() is None
    np.testing.assert_array_equal(np.array(spec.keys), np.array(k[:, :, :3]))  # what was written, no zeros


def test_a_re_feed_from_the_start_of_a_half_written_step_rewrites_it_on_every_layer():
    cache = make_cache(windows=(0, 0))
    k, v = kv(6)
    k2, v2 = kv(6, seed=1)
    forward(cache, 0, k[:, :, :2], v[:, :, :2])
    step(cache, 2, k[:, :, 2:4], v[:, :, 2:4], layer=0)  # a forward that failed before layer 1
    specs = forward(cache, 1, k2[:, :, 1:3], v2[:, :, 1:3])  # re-fed from below its start, every layer
    assert cache.as_control().length == 3 and cache.book.open_step() is None
    want = np.concatenate([np.array(k[:, :, :1]), np.array(k2[:, :, 1:3])], axis=2)
    for spec in specs:
        np.testing.assert_array_equal(np.array(spec.keys), want)


def test_the_same_layer_served_again_opens_a_new_step():
    book = SeqBook(32, [("flat", 0), ("flat", 0)])
    a = book.plan(0, 0, 3)
    book.commit(a, 0)
    book.commit(book.plan(1, 0, 3), 1)
    b = book.plan(0, 3, 3)
    book.commit(b, 0)
    book.commit(book.plan(0, 3, 3), 0)  # layer 0 again, same range: a new step (a re-feed)
    assert book.abort_step() and book.length == 3


def test_a_forward_every_layer_wrote_is_complete_and_not_aborted():
    cache = make_cache(windows=(0, 4))
    k, v = kv(6)
    forward(cache, 0, k[:, :, :3], v[:, :, :3])
    before = book_state(cache)
    assert cache.abort_step() is False  # e.g. the next forward failed before its first layer
    assert book_state(cache) == before


def test_a_commit_without_a_layer_opens_no_step():
    book = SeqBook(32, [("flat", 0)])
    book.commit(book.plan(0, 0, 3))
    assert book.abort_step() is False and book.length == 3


class Boom(Exception):
    pass


def run_stack(stack, cache, x, start, fail_layer=None):
    """One forward of `x` `[1, T, d]` at positions start.., raising at `fail_layer`."""
    positions = list(range(start, start + x.shape[1]))
    for layer, p in enumerate(stack.layers):
        if layer == fail_layer:
            raise Boom(f"layer {layer}")
        q, k, v = stack.project_qkv(p, x)
        spec = cache.update_and_fetch(layer, positions, k, v)
        x = stack.project_out(p, x, attend(q, spec, stack.scale))
        mx.eval(x)
    return x


@pytest.mark.parametrize("fail_layer", [1, 2])
@pytest.mark.parametrize("windows", [(0, 0, 0), (3, 0, 3), (3, 3, 3)])
def test_generation_continues_exactly_as_without_the_failed_step(fail_layer, windows):
    from tests.helpers import TinyStack

    stack = TinyStack(n_layers=3, n_kv_heads=2, head_dim=4)
    x = stack.tokens(16, seed=3)
    outs = {}
    for name in ("failed", "clean"):
        cache = make_cache(windows=windows, capacity=64)
        for start in range(0, 8, 2):
            run_stack(stack, cache, x[:, start : start + 2], start)
        if name == "failed":
            with pytest.raises(Boom):
                run_stack(stack, cache, x[:, 8:10], 8, fail_layer)
            assert cache.abort_step()
            assert cache.as_control().length == 8
        outs[name] = [np.array(run_stack(stack, cache, x[:, s : s + 2], s)) for s in range(8, 16, 2)]
    for got, want in zip(outs["failed"], outs["clean"], strict=True):
        np.testing.assert_array_equal(got, want)
