"""The hookspecs through a real plugin manager: signatures, firstresult, observers.

kvlayout_builders is exercised through real entry points in test_registry.py;
here the CellStepper seams are called the way a cell layout calls them.
"""

from __future__ import annotations

import numpy as np
import pluggy
import pytest

from kvlayout import Builder, CellStep, PluginStepError, StepError, hookimpl
from kvlayout.registry import available, make_plugin_manager


class LowestFree:
    """What the cell plugin ships: the lowest free cells, tried last."""

    @hookimpl(trylast=True)
    def kvlayout_choose_cells(self, free, count):
        return free[:count]


class HighestFree:
    @hookimpl
    def kvlayout_choose_cells(self, free, count):
        return free[::-1][:count]


class Abstains:
    def __init__(self):
        self.asked = []

    @hookimpl
    def kvlayout_choose_cells(self, free, count):
        self.asked.append(count)
        return None


class Recorder:
    def __init__(self):
        self.seen = []

    @hookimpl
    def kvlayout_step_placed(self, step, window):
        self.seen.append((step, window))
        return "ignored"


@pytest.fixture
def pm():
    return make_plugin_manager(entry_points=False)


FREE = np.array([2, 3, 7, 9, 12])


def choose(pm, count, free=FREE, seq_ids=None, positions=None, prev_cells=None, window=0):
    """The hook called as a cell layout calls it: every argument, by name (one new sequence of the flat
    layers' table by default)."""
    return pm.hook.kvlayout_choose_cells(
        free=free,
        count=count,
        seq_ids=np.zeros(count, np.int64) if seq_ids is None else seq_ids,
        positions=np.arange(count) if positions is None else positions,
        prev_cells=np.full(count, -1) if prev_cells is None else prev_cells,
        window=window,
    )


def test_choose_cells_is_firstresult_and_the_trylast_default_loses(pm):
    assert pm.hook.kvlayout_choose_cells.spec.opts["firstresult"] is True
    pm.register(LowestFree())
    assert choose(pm, 2).tolist() == [2, 3]
    pm.register(HighestFree())  # registered later, but the default is trylast either way
    assert choose(pm, 2).tolist() == [12, 9]


def test_choose_cells_skips_a_policy_that_answers_none(pm):
    abstains = Abstains()
    pm.register(LowestFree())
    pm.register(abstains)
    assert choose(pm, 3).tolist() == [2, 3, 7]
    assert abstains.asked == [3]


def test_an_implementation_hears_only_the_arguments_it_declares(pm):
    heard = {}

    class OldSignature:  # written when the hook was kvlayout_choose_cells(free, count)
        @hookimpl
        def kvlayout_choose_cells(self, free, count):
            heard["old"] = (free.tolist(), count)
            return None

    class Subset:
        @hookimpl
        def kvlayout_choose_cells(self, prev_cells, seq_ids, free):
            heard["subset"] = (prev_cells.tolist(), seq_ids.tolist(), free.tolist())
            return None

    pm.register(LowestFree())
    pm.register(OldSignature())
    pm.register(Subset())
    answer = choose(pm, 2, seq_ids=np.array([4, 5]), positions=np.array([7, 0]), prev_cells=np.array([6, -1]))
    assert answer.tolist() == [2, 3]
    assert heard == {"old": (FREE.tolist(), 2), "subset": ([6, -1], [4, 5], FREE.tolist())}


def test_an_old_signature_policy_wins_over_the_cell_plugins_default():
    class OldHighest:
        @hookimpl
        def kvlayout_choose_cells(self, free, count):
            return free[::-1][:count]

    pm = make_plugin_manager()  # with kvlayout-cell's own (trylast) placement
    assert choose(pm, 2, free=np.arange(200)).tolist() == [0, 1]  # a new sequence: its fresh page's first cells
    pm.register(OldHighest())
    assert choose(pm, 2, free=np.arange(200)).tolist() == [199, 198]


def test_choose_cells_with_no_plugin_answers_none(pm):
    assert choose(pm, 1) is None


def test_step_placed_reaches_every_observer(pm):
    first, second = Recorder(), Recorder()
    pm.register(first)
    pm.register(second)
    step = CellStep(length=2, read_len=3, cells=np.array([0, 2], np.int32), mask=np.ones((2, 3), bool))
    pm.hook.kvlayout_step_placed(step=step, window=4)
    assert first.seen == [(step, 4)] and second.seen == [(step, 4)]
    assert pm.hook.kvlayout_step_placed.spec.opts["firstresult"] is False


def test_an_implementation_with_an_argument_the_spec_lacks_is_refused(pm):
    class Wrong:
        @hookimpl
        def kvlayout_choose_cells(self, free, n):
            return free[:n]

    with pytest.raises(pluggy.PluginValidationError):
        pm.register(Wrong())


def test_an_implementation_may_take_fewer_arguments(pm):
    class OnlyWindow:
        def __init__(self):
            self.windows = []

        @hookimpl
        def kvlayout_step_placed(self, window):
            self.windows.append(window)

    plugin = OnlyWindow()
    pm.register(plugin)
    pm.hook.kvlayout_step_placed(step=None, window=0)
    assert plugin.windows == [0]


def test_kvlayout_builders_results_are_collected_from_every_plugin(pm):
    def builder(kind):
        return Builder("t", kind, lambda config: kind)

    class A:
        @hookimpl
        def kvlayout_builders(self):
            return [builder("a")]

    class B:
        @hookimpl
        def kvlayout_builders(self):
            return (builder(k) for k in ("b1", "b2"))  # any iterable of records, as conda's hooks yield

    pm.register(A())
    pm.register(B())
    assert sorted(b.key for b in available(pm)) == ["t:a", "t:b1", "t:b2"]
    assert [b.build("cfg") for b in available(pm)] == ["a", "b1", "b2"]


# -- the registry's guard: every implementation is called through it, named


class Raises:
    def __init__(self, exc):
        self.exc = exc

    @hookimpl
    def kvlayout_choose_cells(self, free, count):
        raise self.exc


def test_a_policy_that_raises_is_named_with_its_hook_and_the_exception_chained(pm):
    pm.register(LowestFree())
    pm.register(Raises(ValueError("no room at the inn")), name="raiser")
    with pytest.raises(PluginStepError) as info:
        choose(pm, 2)
    assert str(info.value) == "plugin 'raiser': kvlayout_choose_cells raised ValueError: no room at the inn"
    assert (info.value.plugin, info.value.hook) == ("raiser", "kvlayout_choose_cells")
    assert isinstance(info.value.__cause__, ValueError)
    assert isinstance(info.value, StepError)  # a refusal of the step, as the layout's own are


def test_an_unnamed_plugin_instance_is_named_by_its_class(pm):
    pm.register(Raises(KeyError(3)))
    with pytest.raises(PluginStepError, match=r"^plugin 'Raises': kvlayout_choose_cells raised KeyError: 3$"):
        choose(pm, 1)


@pytest.mark.parametrize(
    "answer, why",
    [
        ([2, 2], "cell 2 more than once"),
        ([2], "1 cell(s)"),
        ([2, 3, 7], "3 cell(s)"),
        ([2, 4], "cell 4 is not free"),
        ([-3, 2], "cell -3 is not free"),
        ([2.0, 3.0], "float64 values, not integers"),
        ([True, False], "bool values, not integers"),
        (np.array([[2, 3]]), "a 2-d array"),
        (7, "a single int"),
        ("cells", "a single str"),
    ],
)
def test_a_bad_placement_answer_is_refused_quoting_it_as_a_list(pm, answer, why):
    pm.register(Answer(answer), name="policy")
    with pytest.raises(PluginStepError) as info:
        choose(pm, 2)
    assert str(info.value) == (
        f"plugin 'policy': kvlayout_choose_cells answered {answer_text(answer)}: "
        f"expected 2 distinct cells from the free list ({why})"
    )
    assert "array(" not in str(info.value)


def answer_text(answer):
    return repr(np.asarray(answer).tolist()) if isinstance(answer, (list, np.ndarray)) else repr(answer)


class Answer:
    def __init__(self, answer):
        self.answer = answer

    @hookimpl
    def kvlayout_choose_cells(self, free, count):
        return self.answer


def test_a_long_bad_answer_is_quoted_short():
    from kvlayout.registry import quote

    assert quote(np.arange(100)) == "[0, 1, 2, 3, 4, 5, 6, 7, ... 100 in all]"
    assert len(quote("x" * 500)) == 120


@pytest.mark.parametrize("answer", [[12, 3], np.array([9, 2], np.int32), (7, 9)])
def test_a_good_answer_in_any_order_or_integer_type_passes_the_guard_unchanged(pm, answer):
    pm.register(Answer(answer))
    assert choose(pm, 2) is answer


class Heard:
    def __init__(self, log, tag, fail=False):
        self.log, self.tag, self.fail = log, tag, fail

    @hookimpl
    def kvlayout_step_placed(self, step, window):
        self.log.append(self.tag)
        if self.fail:
            raise RuntimeError(f"{self.tag} broke")


def test_an_observer_that_raises_does_not_stop_the_others_hearing_and_is_raised_after(pm):
    log = []
    pm.register(Heard(log, "first"), name="first")
    pm.register(Heard(log, "broken", fail=True), name="broken")
    pm.register(Heard(log, "also broken", fail=True), name="also")
    pm.register(Heard(log, "last"), name="last")
    with pytest.raises(PluginStepError) as info:
        pm.hook.kvlayout_step_placed(step=None, window=0)
    assert sorted(log) == ["also broken", "broken", "first", "last"]  # every observer heard
    # pluggy calls the latest registered first: "also" failed first, and is the one raised.
    assert str(info.value) == "plugin 'also': kvlayout_step_placed raised RuntimeError: also broken broke"
    log.clear()
    pm.unregister(name="also")
    pm.unregister(name="broken")
    assert pm.hook.kvlayout_step_placed(step=None, window=0) == [] and sorted(log) == ["first", "last"]


def test_a_wrapper_is_not_guarded_and_still_wraps(pm):
    seen = []

    class Wrapper:
        @hookimpl(wrapper=True)
        def kvlayout_choose_cells(self, free, count):
            answer = yield
            seen.append(list(answer))
            return answer

    pm.register(LowestFree())
    pm.register(Wrapper())
    assert choose(pm, 2).tolist() == [2, 3] and seen == [[2, 3]]


def test_a_wrapper_that_replaces_the_answer_with_a_bad_one_is_the_plugin_named(pm):
    class Replaces:
        @hookimpl(wrapper=True)
        def kvlayout_choose_cells(self, free, count):
            yield
            return [2, 2]

    pm.register(LowestFree(), name="lowest")
    pm.register(Replaces(), name="replaces")
    with pytest.raises(
        PluginStepError, match=r"^plugin 'replaces': kvlayout_choose_cells answered \[2, 2\]: .*more than once"
    ):
        choose(pm, 2)


def test_the_registry_calls_implementations_through_pluggy_leaving_its_records_as_pluggy_made_them():
    pm = make_plugin_manager()  # the shipped plugins, guarded
    pm.register(HighestFree(), name="highest")
    for caller in pm.hook.__dict__.values():
        for impl in caller.get_hookimpls():
            # each implementation pluggy calls is the attribute it found on the object registered
            assert any(getattr(impl.plugin, a, None) == impl.function for a in dir(impl.plugin)), impl
    assert choose(pm, 2, free=np.arange(200)).tolist() == [199, 198]


def test_an_observer_registered_or_unregistered_between_steps_counts_at_the_next_step(pm):
    # `observed` keeps its answer per registration generation: a layout asking before and after a plugin
    # comes or goes hears the truth each time (the plain-Python oracle: what pluggy's implementations say).
    from kvlayout.registry import observed

    def truth():
        return any(impl.plugin_name not in ("kvlayout",) and "guarded" in impl.plugin_name
                   for impl in pm.hook.kvlayout_step_placed.get_hookimpls())

    answers = [observed(pm, "kvlayout_step_placed")]
    recorder = Recorder()
    pm.register(recorder, name="rec")
    answers.append(observed(pm, "kvlayout_step_placed"))
    answers.append(observed(pm, "kvlayout_step_placed"))  # asked again: kept
    assert truth()
    pm.unregister(name="rec")
    answers.append(observed(pm, "kvlayout_step_placed"))
    assert not truth()
    assert answers == [False, True, True, False]
    assert observed(pm, "kvlayout_step_aborted") is False
