"""StepPositions: a forward's positions checked once, frozen for every layer that reads them."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from kvlayout.errors import StepError
from kvlayout.positions import StepPositions, frozen, step_positions


@pytest.mark.parametrize("given", [[3, 4, 5], (3, 4, 5), range(3, 6), np.array([3, 4, 5]), mx.array([3, 4, 5])])
def test_any_integer_sequence_becomes_the_same_frozen_positions(given):
    p = StepPositions(given)
    assert p.host.dtype == np.int64 and p.host.tolist() == [3, 4, 5]
    assert (p.first, p.consecutive, p.size, len(p)) == (3, True, 3, 3)
    assert np.asarray(p).tolist() == [3, 4, 5]


@pytest.mark.parametrize("given, first, consecutive", [
    ([7], 7, True), ([], None, False), ([2, 4], 2, False), ([5, 4], 5, False), ([1, 1], 1, False),
    (range(0, 10, 3), 0, False), ([9, 10, 11, 12], 9, True),
])
def test_first_and_consecutive_say_what_the_positions_are(given, first, consecutive):
    p = StepPositions(given)
    assert (p.first, p.consecutive) == (first, consecutive)


def test_nobody_can_change_them_once_made():
    # Neither the caller's array, nor a holder of `host`, nor one making it writable again: every
    # layer after the first reads what the first checked.
    source = np.array([3, 4, 5])
    p = StepPositions(source)
    source[0] = 99
    assert p.host.tolist() == [3, 4, 5]
    with pytest.raises(ValueError):
        p.host[0] = 7
    with pytest.raises(ValueError):
        p.host.flags.writeable = True
    with pytest.raises(ValueError):
        p.host.base.flags.writeable = True  # nor through what it is a view of
    with pytest.raises(AttributeError):
        p.host = np.array([7, 8, 9])
    own = np.arange(3)
    kept = frozen(own)
    own[0] = 5
    assert kept.tolist() == [0, 1, 2]
    with pytest.raises(ValueError):
        kept.flags.writeable = True


def test_they_read_as_the_sequence_of_ints_the_contract_names():
    p = StepPositions([3, 4, 5])
    assert list(p) == [3, 4, 5] and p[1] == 4 and p.tolist() == [3, 4, 5]
    copied = np.array(p, copy=True)
    copied[0] = 9  # a copy asked for is the caller's own
    assert p.host.tolist() == [3, 4, 5] and np.asarray(p, dtype=np.int32).dtype == np.int32


@pytest.mark.parametrize("bad", [[1.5], [True], np.array([[1, 2]]), "12", [2**64]])
def test_what_is_not_integers_is_refused_by_name(bad):
    with pytest.raises(StepError, match="^positions"):
        StepPositions(bad)


def test_step_positions_takes_one_as_it_is_and_checks_anything_else():
    p = StepPositions([1, 2])
    assert step_positions(p) is p
    assert step_positions([1, 2]).host.tolist() == [1, 2]


@pytest.mark.parametrize("run", [range(0), range(4, 4), range(5, 3), range(7, 8), range(0, 33), range(2**62, 2**62 + 3),
                                 range(2**63 - 3, 2**63 - 1), range(-2, 2)])
def test_a_run_from_a_range_is_what_its_list_would_be(run):
    # Ranges skip the array until `host` is read: every answer is the list path's (the oracle), and frozen alike.
    p, listed = StepPositions(run), StepPositions(list(run))
    assert (p.first, p.consecutive, p.size, len(p)) == (listed.first, listed.consecutive, listed.size, len(listed))
    assert p.host.dtype == np.int64 and p.host.tolist() == listed.host.tolist() == list(run)
    with pytest.raises(ValueError):
        p.host.flags.writeable = True
    for name in ("host", "_host", "size", "first"):
        with pytest.raises(AttributeError):
            setattr(p, name, 1)


@pytest.mark.parametrize("run", [range(2**63 - 1, 2**63 + 1), range(-1, 2**63 - 1), range(-(2**63) + 1, 2**63 - 1)])
def test_a_range_past_64_bits_or_too_long_to_count_is_refused_by_name(run):
    with pytest.raises(StepError, match="^positions"):
        StepPositions(run)


@pytest.mark.parametrize("listed", [[5], [5, 6, 7], [7, 5, 6], [3, 3], [-1, 0], [0, 2, 3], list(range(64)),
                                    list(range(65)), [2**63 - 1, 0], list(range(10, 0, -1))])
def test_a_list_of_ints_is_what_its_array_would_be(listed):
    # A few Python ints are frozen in one call and checked in Python: every answer is the array path's.
    p, oracle = StepPositions(listed), StepPositions(np.array(listed, dtype=np.int64))
    assert (p.first, p.consecutive, p.size) == (oracle.first, oracle.consecutive, oracle.size)
    assert p.host.dtype == np.int64 and p.host.tolist() == listed
    with pytest.raises(ValueError):
        p.host.flags.writeable = True
    base = p.host.base
    while isinstance(base, np.ndarray):  # nothing beneath it can be made writable either
        with pytest.raises(ValueError):
            base.flags.writeable = True
        base = base.base
    assert type(base) is bytes  # immutable memory at the bottom
    # The ints themselves, for a layout that checks a decode step's few in Python: a copy of the caller's.
    assert p.listed == oracle.listed == tuple(listed) and all(type(v) is int for v in p.listed)
    listed.append(1)
    assert p.listed == oracle.listed and p.host.tolist() == list(oracle.listed)


@pytest.mark.parametrize("bad", [[1, True], [2**63], [1, 2.0], [-(2**63) - 1]])
def test_a_list_the_few_ints_path_cannot_take_is_refused_by_name(bad):
    with pytest.raises(StepError, match="^positions"):
        StepPositions(bad)

