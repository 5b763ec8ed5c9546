"""The error hierarchy: one root, and the standard bases callers already catch."""

from __future__ import annotations

import pytest

import kvlayout
from kvlayout import errors

EXPECTED_BASES = {
    "ConfigError": (ValueError,),
    "LayoutNotFound": (LookupError,),
    "DuplicateLayout": (),
    "StepError": (RuntimeError,),
    "PluginError": (),
    "PluginStepError": (errors.StepError, errors.PluginError, RuntimeError),
    "CapacityError": (),
    "SequenceError": (ValueError,),
    "StateError": (),
    "RunEnded": (),
}


@pytest.mark.parametrize("name, bases", EXPECTED_BASES.items())
def test_every_error_derives_from_the_root_and_its_standard_base(name, bases):
    cls = getattr(errors, name)
    assert issubclass(cls, errors.KVLayoutError)
    for base in bases:
        assert issubclass(cls, base)
    assert getattr(kvlayout, name) is cls  # re-exported at the top level


def test_the_root_is_an_exception_and_re_exported():
    assert issubclass(errors.KVLayoutError, Exception)
    assert kvlayout.KVLayoutError is errors.KVLayoutError


def test_a_plugin_error_carries_the_plugin_and_hook_it_names():
    err = errors.PluginStepError(
        "plugin 'p' from kvlayout-x 1.0: kvlayout_choose_cells raised ValueError: no",
        plugin="p", distribution="kvlayout-x", version="1.0", hook="kvlayout_choose_cells",
        reason="kvlayout_choose_cells raised ValueError: no",
    )
    assert (err.plugin, err.distribution, err.version, err.hook) == ("p", "kvlayout-x", "1.0", "kvlayout_choose_cells")
    assert err.reason == "kvlayout_choose_cells raised ValueError: no" and err.keys == ()
    assert errors.PluginError("bare").reason == "bare"
    assert not issubclass(errors.PluginError, errors.StepError)  # a failed build is not a step's fault


def test_errors_that_are_not_value_errors_are_not_caught_as_such():
    assert not issubclass(errors.StepError, ValueError)
    assert not issubclass(errors.DuplicateLayout, LookupError)
    assert not issubclass(errors.CapacityError, (ValueError, RuntimeError, LookupError))


def test_a_config_error_is_caught_by_a_plain_value_error_handler():
    with pytest.raises(ValueError):
        kvlayout.CacheConfig(capacity=0, n_layers=1, layers=[kvlayout.LayerConfig(1, 8)])


def test_every_error_class_of_the_module_is_covered_here():
    declared = {
        name for name, obj in vars(errors).items()
        if isinstance(obj, type) and issubclass(obj, errors.KVLayoutError) and obj is not errors.KVLayoutError
    }
    assert declared == set(EXPECTED_BASES)
