"""The error vocabulary: one root, every exception class in kvlayout/errors.py, no bare
ValueError or RuntimeError raised, the one way an exception is said in a line, and the
shared value checks' refusals (kvlayout.checks)."""

from __future__ import annotations

import ast
import builtins
import errno
import math
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import kvlayout
from kvlayout import checks, errors

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [ROOT / "core" / "kvlayout", ROOT / "plugins" / "seq_layout" / "kvlayout_seq",
           ROOT / "plugins" / "cell_layout" / "kvlayout_cell"]
ERRORS_PY = ROOT / "core" / "kvlayout" / "errors.py"

# Every KVLayoutError of errors.py, the standard bases callers already catch, and whether the
# top-level package re-exports it (the errors a plugin or a library user meets).
EXPECTED_BASES = {
    "ConfigError": ((ValueError,), True),
    "LayoutNotFound": ((LookupError,), True),
    "DuplicateLayout": ((), True),
    "StepError": ((RuntimeError,), True),
    "ShapeError": ((ValueError,), True),
    "PluginError": ((), True),
    "PluginStepError": ((errors.StepError, errors.PluginError, RuntimeError), True),
    "CapacityError": ((), True),
    "SequenceError": ((ValueError,), True),
    "StateError": ((), True),
    "SaveFailed": ((errors.StateError,), False),
    "InstallError": ((), False),
    "MissingExtra": ((), False),
    "RunEnded": ((), True),
    "DistributedError": ((errors.RunEnded,), False),
    "LeaderRefused": ((), False),
    "ForwardFailed": ((), False),
    "BadRequest": ((), False),
    "QueueFull": ((), False),
}


@pytest.mark.parametrize("name, bases, public", [(n, b, p) for n, (b, p) in EXPECTED_BASES.items()])
def test_every_error_derives_from_the_root_and_its_standard_base(name, bases, public):
    cls = getattr(errors, name)
    assert issubclass(cls, errors.KVLayoutError)
    for base in bases:
        assert issubclass(cls, base)
    if public:
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


def test_ctrl_c_errors_stay_keyboard_interrupts_outside_the_root():
    assert issubclass(errors.RunInterrupted, errors.Interrupted)
    assert issubclass(errors.Interrupted, KeyboardInterrupt) and not issubclass(errors.Interrupted, Exception)
    assert errors.RunInterrupted().save_failed is None
    failed = errors.SaveFailed("--save-state d: abandoned", True)
    assert errors.RunInterrupted(failed).save_failed is failed and failed.interrupted


# -- what the server answers: the status the error carries


def test_only_a_client_s_error_carries_an_http_status():
    assert errors.KVLayoutError("x").status is None and errors.ConfigError("x").status is None
    bad = errors.BadRequest("n=0: expected an integer in [1, 4]", "n")
    assert (bad.status, bad.param, bad.kind, bad.code, bad.message) == (
        400, "n", "invalid_request_error", None, str(bad)
    )
    full = errors.QueueFull("3 requests are waiting (server.queue=3)")
    assert (full.status, full.kind, full.code, full.param) == (429, "rate_limit_error", "rate_limit_exceeded", None)
    assert str(full) == "the server is busy: 3 requests are waiting (server.queue=3); retry later"


def test_a_failed_forward_says_its_cause_and_whether_a_retry_may_mend_it():
    plain = errors.ForwardFailed(OSError("disk gone"))
    assert str(plain) == "OSError: disk gone" and plain.retry and isinstance(plain.cause, OSError)
    plugin = errors.ForwardFailed(errors.PluginStepError("plugin 'p': kvlayout_choose_cells raised"))
    assert str(plugin) == "plugin 'p': kvlayout_choose_cells raised" and not plugin.retry


# -- one line of an exception


@pytest.mark.parametrize(
    "reason, line",
    [
        (ValueError("Expecting value: line 1\n  column 2"), "Expecting value: line 1 column 2"),
        ("  a\tb\r\n\nc  ", "a b c"),
        (KeyError("k"), "'k'"),
        (RuntimeError(), ""),
        (OSError(errno.EACCES, "Permission denied", "/x/y"), "[Errno 13] Permission denied: '/x/y'"),
    ],
)
def test_one_line_turns_every_run_of_whitespace_into_one_space(reason, line):
    assert errors.one_line(reason) == line


def test_the_os_reason_is_its_own_words_without_errno_or_path():
    assert errors.os_reason(OSError(errno.ENOENT, "No such file or directory", "/x/y")) == "No such file or directory"
    assert errors.os_reason(OSError("odd\nfailure")) == "odd failure"  # no strerror: its one line


# -- the value checks every part shares (kvlayout.checks), each refusal naming the value


@pytest.mark.parametrize(
    "value, ok",
    [(0, True), (-2.5, True), (1e308, True), (np.float32(0.5), True), (np.int64(3), True), (10**300, True),
     (math.nan, False), (math.inf, False), (-math.inf, False), (10**400, False), (True, False),
     (np.bool_(False), False), ("1", False), (None, False), ([1.0], False), (np.array(1.0), False)],
)
def test_finite_is_a_real_number_neither_nan_nor_infinite_nor_past_float_range(value, ok):
    assert checks.finite(value) is ok


@pytest.mark.parametrize(
    "value, low, high, from_json, message",
    [
        (math.nan, None, None, False, "t=nan: expected a finite number"),
        (10**400, 0, None, True, "t=" + "1" + "0" * 58 + "…: expected a finite number >= 0"),
        (-0.5, 0, 2, False, "t=-0.5: expected a finite number in [0, 2]"),
        (3, None, 2.5, False, "t=3: expected a finite number <= 2.5"),
        (True, None, None, True, "t=true: expected a finite number"),
    ],
)
def test_finite_number_refuses_naming_the_value_and_the_range(value, low, high, from_json, message):
    with pytest.raises(errors.ConfigError) as info:
        checks.finite_number("t", value, errors.ConfigError, low, high, from_json=from_json)
    assert str(info.value) == message
    assert checks.finite_number("t", 2, errors.ConfigError, 0, 2) == 2.0 and (
        checks.finite_number("t", 0.0, errors.ConfigError) == 0.0
    )


@pytest.mark.parametrize(
    "value, low, high, from_json, message",
    [
        (0, 1, None, False, "n=0: expected an integer >= 1"),
        (1.5, 0, 4, False, "n=1.5: expected an integer in [0, 4], got float"),
        ("5", None, None, True, 'n="5": expected an integer, got a string'),
        (None, 0, 2**63 - 1, True, "n=null: expected an integer >= 0 that fits in 64 bits, got null"),
        (2**64, 0, 2**63 - 1, False, f"n={2**64}: expected an integer >= 0 that fits in 64 bits"),
        (-1, 0, 2**128 - 1, True, "n=-1: expected an integer in [0, 2**128 - 1]"),
        (0, 0, -1, True, "n=0: expected no value (none fits here)"),
        (True, None, 1, False, "n=True: expected an integer <= 1, got bool"),
    ],
)
def test_int_scalar_refuses_naming_the_value_and_the_range(value, low, high, from_json, message):
    with pytest.raises(errors.StateError) as info:
        checks.int_scalar("n", value, errors.StateError, low, high, numpy=False, from_json=from_json)
    assert str(info.value) == message


# -- the rules, over every module of the three distributions


def modules() -> list[Path]:
    return sorted(path for root in SOURCES for path in root.rglob("*.py"))


def exception_names() -> set[str]:
    """Names a class derives from to be an exception: the builtins' and errors.py's."""
    names = {n for n, v in vars(builtins).items() if isinstance(v, type) and issubclass(v, BaseException)}
    return names | {n for n, v in vars(errors).items() if isinstance(v, type) and issubclass(v, BaseException)}


def base_name(node: ast.expr) -> str:
    return ast.unparse(node).rpartition(".")[2]


def exception_classes_in(source: str) -> list[str]:
    """Classes `source` defines whose base is an exception (or named like one: a library's)."""
    known = exception_names()
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            bases = [base_name(b) for b in node.bases]
            if any(b in known or b.endswith(("Error", "Exception", "Interrupt")) for b in bases):
                found.append(f"{node.lineno} {node.name}({', '.join(bases)})")
    return found


def bare_raises_in(source: str) -> list[str]:
    """`raise ValueError(...)`, `raise RuntimeError(...)` or `raise Exception(...)` in `source`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Raise) and node.exc is not None:
            raised = node.exc.func if isinstance(node.exc, ast.Call) else node.exc
            if isinstance(raised, ast.Name) and raised.id in ("ValueError", "RuntimeError", "Exception"):
                found.append(f"{node.lineno} {raised.id}")
    return found


def test_the_rules_below_find_what_they_forbid():
    source = textwrap.dedent("""\
        import jinja2
        class Oops(ValueError): pass
        class Mine(errors.StepError): pass
        class Theirs(jinja2.TemplateError): pass
        class Fine: pass
        def f():
            raise RuntimeError("no")
        def g():
            raise ValueError
        def h():
            raise errors.ConfigError("x: expected y")
    """)
    assert exception_classes_in(source) == ["2 Oops(ValueError)", "3 Mine(StepError)", "4 Theirs(TemplateError)"]
    assert bare_raises_in(source) == ["7 RuntimeError", "9 ValueError"]


def test_every_exception_class_is_defined_in_errors_py():
    outside = [f"{path.relative_to(ROOT)}:{found}" for path in modules() if path != ERRORS_PY
               for found in exception_classes_in(path.read_text())]
    assert outside == [], "exception classes outside kvlayout/errors.py: " + "; ".join(outside)


def test_no_module_defines_an_exception_class_outside_errors_py_once_imported():
    # What the parse cannot see (a base imported under another name): every module imported, in a
    # fresh interpreter so no import's side effect reaches the other tests.
    script = textwrap.dedent("""
        import importlib, inspect, pkgutil
        found = []
        for top in ("kvlayout", "kvlayout_seq", "kvlayout_cell"):
            package = importlib.import_module(top)
            names = [top] + [m.name for m in pkgutil.walk_packages(package.__path__, top + ".")]
            for name in names:
                module = importlib.import_module(name)
                for attr, value in vars(module).items():
                    if (inspect.isclass(value) and issubclass(value, BaseException) and value.__module__ == name
                            and name != "kvlayout.errors"):
                        found.append(f"{name}.{attr}")
        print("\\n".join(found))
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == []


def test_no_bare_value_error_or_runtime_error_is_raised():
    bare = [f"{path.relative_to(ROOT)}:{found}" for path in modules() for found in bare_raises_in(path.read_text())]
    assert bare == [], "raise the project's error that names what and where: " + "; ".join(bare)
