"""Bad plugins: every way a plugin can misbehave, one row each, through the API and the real command.

Each row installs one fake distribution `kvlayout-bad-<row>` 1.0 (entry point
`p`, module `kvl_bad_<row>`) with the `fake_dists` fixture, or, for the rows
in SUBPROCESS, in a site directory of its own on the PYTHONPATH of the real
command, run in a subprocess (two at a time, each table's once per module).

- REGISTRATION: a plugin that cannot count (it fails to import, implements a
  hook kvlayout does not have, or its `kvlayout_builders` raises or answers
  anything but a list of valid Builders). It is skipped, recorded under
  `failures` with its distribution and the hook, nothing of it registered;
  the shipped layouts still resolve, `kvlayout plugins` shows it under
  "failed" and exits 0, and `kvlayout run --layout fake:x` says why in one line.
- BUILDERS: a Builder whose build/load raises or returns None, or builds a
  cache the runner cannot drive: one line naming the layout and distribution.
- STEP_HOOKS: a placement policy or an observer misbehaving during a step.
  Through the API the step is refused (a PluginStepError naming the plugin
  and the hook) and the cell table is as it was before the refused call: the
  same call succeeds once the plugin is gone. Through `kvlayout run` every
  sample the failing steps carried is an error, the reason is said once on
  stderr naming the plugin and the hook, and the exit is 1.

The oracle is written out per row (the exact reason), never derived from the
code under test; control rows (plugins that behave) must pass unchanged.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import mlx.core as mx
import pytest

import kvlayout
from kvlayout import CacheConfig, LayerConfig, LayoutNotFound, PluginError, PluginStepError, StepError, registry
from kvlayout.registry import make_plugin_manager, resolve

HEAD = "from kvlayout import Builder, hookimpl\nimport numpy as np\n\n"
GOOD_BUILD = "def _b(config):\n    import kvlayout\n    return kvlayout.build('mlx', 'seq', config)\n\n"


def builders(answer: str, before: str = "") -> str:
    return HEAD + GOOD_BUILD + before + f"@hookimpl\ndef kvlayout_builders():\n    return {answer}\n"


def hook(body: str, name: str = "kvlayout_choose_cells", args: str = "free, count", opts: str = "") -> str:
    return HEAD + f"@hookimpl{opts}\ndef {name}({args}):\n" + textwrap.indent(textwrap.dedent(body), "    ")


def dist_of(row: str) -> str:
    return f"kvlayout-bad-{row}"


def module_of(row: str) -> str:
    return "kvl_bad_" + row.replace("-", "_")


def install(fake_dists, row: str, source: str, target: str | None = None) -> str:
    """Install row `row` as distribution kvlayout-bad-<row> 1.0; its name."""
    module = module_of(row)
    if target == "twice":
        eps = {"p": module, "q": module}
    else:
        eps = {"p": (target or "{m}").format(m=module)}
    fake_dists.add(dist_of(row), "1.0", eps, {module: source})
    return dist_of(row)


# -- registration: skipped, recorded, named --------------------------------------------------------

# row -> (source, entry point target or None, the failure's hook, its error exactly or None, a fragment, keys)
REGISTRATION = {
    # the items
    "misspelled-builders-hook": (
        HEAD + GOOD_BUILD + "@hookimpl\ndef kvlayout_builder():\n    return [Builder('fake', 'x', _b)]\n", None, None,
        "implements kvlayout_builder, which is not a kvlayout hook; did you mean kvlayout_builders?", None, ()),
    "builders-raises": (
        HEAD + "@hookimpl\ndef kvlayout_builders():\n    raise RuntimeError('boom in builders')\n", None,
        "kvlayout_builders", "kvlayout_builders raised RuntimeError: boom in builders", None, ()),
    "builders-returns-one-builder": (
        builders("Builder('fake', 'x', _b)"), None, "kvlayout_builders",
        "kvlayout_builders returned one Builder (fake:x), not a list: expected a list of Builder records ([] for none)",
        None, ("fake:x",)),
    "builders-returns-a-non-builder": (
        builders("['fake:x']"), None, "kvlayout_builders",
        "kvlayout_builders returned 'fake:x' among its records: expected Builder records", None, ()),
    # the other members of the class
    "misspelled-observer-hook": (
        hook("pass", name="kvlayout_step_place", args="step, window"), None, None,
        "implements kvlayout_step_place, which is not a kvlayout hook; did you mean kvlayout_step_placed?", None, ()),
    "an-argument-the-hookspec-lacks": (
        hook("return free[:n]", args="free, n"), None, None, None,
        "Argument(s) {'n'} are declared in the hookimpl but can not be found in the hookspec", ()),
    "a-hookwrapper-that-is-no-generator": (
        hook("return None", opts="(hookwrapper=True)"), None, None, None, "PluginValidationError", ()),
    "an-unknown-hookimpl-option": (
        HEAD + "@hookimpl(firstresult=True)\ndef kvlayout_builders():\n    return []\n", None, None, None,
        "TypeError", ()),
    "import-raises": (
        "raise ImportError('no native library')\n", None, None, "ImportError: no native library", None, ()),
    "import-calls-sys-exit": ("import sys\nsys.exit(3)\n", None, None, "SystemExit: 3", None, ()),
    "builders-calls-sys-exit": (
        HEAD + "import sys\n\n@hookimpl\ndef kvlayout_builders():\n    sys.exit(4)\n", None, "kvlayout_builders",
        "kvlayout_builders raised SystemExit: 4", None, ()),
    "entry-point-names-a-missing-attribute": (
        HEAD, "{m}:nothere", None, None, "AttributeError: module 'kvl_bad_entry_point_names_a_missing_attribute'", ()),
    "builders-returns-none": (
        builders("None"), None, "kvlayout_builders",
        "kvlayout_builders returned None: expected a list of Builder records ([] for none)", None, ()),
    "builders-returns-a-dict": (
        builders("{'fake': 'x'}"), None, "kvlayout_builders",
        "kvlayout_builders returned {'fake': 'x'}: expected a list of Builder records ([] for none)", None, ()),
    "builders-returns-a-string": (
        builders("'fake:x'"), None, "kvlayout_builders",
        "kvlayout_builders returned 'fake:x': expected a list of Builder records ([] for none)", None, ()),
    "a-builder-and-a-non-builder": (
        builders("[Builder('fake', 'x', _b), 3]"), None, "kvlayout_builders",
        "kvlayout_builders returned 3 among its records: expected Builder records", None, ("fake:x",)),
    "a-generator-raising-midway": (
        HEAD + GOOD_BUILD + "@hookimpl\ndef kvlayout_builders():\n    yield Builder('fake', 'x', _b)\n"
        "    raise ValueError('midway')\n", None, "kvlayout_builders",
        "kvlayout_builders raised ValueError: midway", None, ("fake:x",)),
    "a-builder-with-an-empty-kind": (
        builders("[Builder('fake', '', _b)]"), None, "kvlayout_builders",
        "kvlayout_builders returned a Builder with kind='': expected a non-empty name without ':' or spaces", None, ()),
    "a-builder-with-kind-none": (
        builders("[Builder('fake', None, _b)]"), None, "kvlayout_builders",
        "kvlayout_builders returned a Builder with kind=None: expected a non-empty name without ':' or spaces",
        None, ()),
    "a-builder-with-a-colon-in-its-kind": (
        builders("[Builder('fake', 'x:y', _b)]"), None, "kvlayout_builders",
        "kvlayout_builders returned a Builder with kind='x:y': expected a non-empty name without ':' or spaces",
        None, ()),
    "a-build-that-is-not-callable": (
        builders("[Builder('fake', 'x', 'not callable')]"), None, "kvlayout_builders",
        "kvlayout_builders returned Builder fake:x whose build is 'not callable': expected a callable", None,
        ("fake:x",)),
    "a-load-that-is-not-callable": (
        builders("[Builder('fake', 'x', _b, load=3)]"), None, "kvlayout_builders",
        "kvlayout_builders returned Builder fake:x whose load is 3: expected a callable or None", None, ("fake:x",)),
    "a-summary-that-is-not-a-string": (
        builders("[Builder('fake', 'x', _b, None)]"), None, "kvlayout_builders",
        "kvlayout_builders returned Builder fake:x whose summary is None: expected a string", None, ("fake:x",)),
    "one-key-claimed-twice": (
        builders("[Builder('fake', 'x', _b), Builder('fake', 'x', _b)]"), None, "kvlayout_builders",
        "kvlayout_builders returned two Builders for fake:x", None, ("fake:x",)),
    "one-module-under-two-entry-points": (
        builders("[Builder('fake', 'twice', _b)]"), "twice", None, None, "ValueError: Plugin already registered", ()),
}


def check_failure(failure, hook, error, fragment):
    assert failure.hook == hook and failure.version == "1.0"
    if error is not None:
        assert failure.error == error
    else:
        assert fragment in failure.error and "\n" not in failure.error


@pytest.mark.parametrize("row", REGISTRATION, ids=REGISTRATION)
def test_a_plugin_that_cannot_count_is_skipped_recorded_and_named(fake_dists, row):
    source, target, hook_name, error, fragment, keys = REGISTRATION[row]
    dist = install(fake_dists, row, source, target)
    pm = make_plugin_manager()
    [failure] = [f for f in pm.failures if f.distribution == dist]
    check_failure(failure, hook_name, error, fragment)
    assert failure.keys == keys
    assert failure.entry_point == ("q" if target == "twice" else "p")
    # Nothing of it registered (the first of the two entry points of one module is a plugin of its own).
    assert [p.name for p in pm.plugins() if p.distribution == dist] == (["p"] if target == "twice" else [])
    assert resolve("mlx", "cell", pm).distribution == "kvlayout-cell"  # every other layout keeps working
    assert resolve("mlx", "seq", pm).distribution == "kvlayout-seq"
    with pytest.raises(LayoutNotFound) as info:  # resolving what it would have provided says why
        resolve("fake", "x", pm)
    message = str(info.value)
    if keys:
        assert message == f"layout fake:x is not available: plugin 'p' from {dist} 1.0 was skipped: {failure.error}"
    else:
        assert message.startswith("no layout fake:x; available: ")
        assert f"skipped: plugin '{failure.entry_point}' from {dist} 1.0 ({failure.error})" in message


@pytest.mark.parametrize("row", ["builders-raises", "misspelled-builders-hook"])
def test_strict_mode_raises_naming_the_plugin_instead(fake_dists, row):
    source, target, hook_name, error, _, _ = REGISTRATION[row]
    dist = install(fake_dists, row, source, target)
    with pytest.raises(PluginError) as info:
        make_plugin_manager(strict=True)
    assert str(info.value) == f"plugin 'p' from {dist} 1.0 failed to load: {error}"
    assert (info.value.distribution, info.value.hook) == (dist, hook_name)


def test_a_builders_hook_yielding_good_records_is_a_good_plugin(fake_dists):
    dist = install(fake_dists, "yields", HEAD + GOOD_BUILD + "@hookimpl\ndef kvlayout_builders():\n"
                   "    yield Builder('fake', 'x', _b, 'yielded')\n")
    pm = make_plugin_manager()
    assert not pm.failures
    assert (resolve("fake", "x", pm).distribution, resolve("fake", "x", pm).summary) == (dist, "yielded")


# -- the commands, in subprocesses, with each row in a site directory of its own ---------------------

ROOT = Path(__file__).resolve().parents[2]


def site_with(tmp: Path, rows: dict[str, tuple[str, str | None]]) -> Path:
    """A site directory holding each row's distribution: {row: (source, target)}."""
    from tests.conftest import FakeDists

    site = tmp / "site"
    site.mkdir(parents=True)
    fakes = FakeDists(site)
    for row, (source, target) in rows.items():
        install(fakes, row, source, target)
    return site


def command(site: Path | None, *args: str) -> subprocess.CompletedProcess:
    path = [str(site)] if site else []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path + [os.environ.get("PYTHONPATH", "")]), "COLUMNS": "200"}
    env.pop("KVLAYOUT_STRICT", None)
    return subprocess.run([sys.executable, "-m", "kvlayout.cli", *args], capture_output=True, text=True, env=env,
                          timeout=180, cwd=ROOT)


def in_parallel(calls: dict) -> dict:
    """Run {name: (site, args)} two at a time; {name: CompletedProcess}."""
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = {name: pool.submit(command, site, *args) for name, (site, args) in calls.items()}
        return {name: f.result() for name, f in futures.items()}


# The rows whose command runs in a subprocess of its own (the items, and one of each path the
# failure takes); the others run `kvlayout.cli.main` in this process, the same code short of the interpreter.
SUBPROCESS = {
    "misspelled-builders-hook", "builders-raises", "builders-returns-one-builder", "builders-returns-a-non-builder",
    "import-raises", "an-argument-the-hookspec-lacks", "a-builder-and-a-non-builder",
    "build-raises", "build-returns-none", "build-returns-a-string",
    "choose-cells-repeats-a-cell", "step-placed-raises", "choose-cells-raises", "choose-cells-answers-taken-cells",
    "step-placed-raises-on-the-ring-window", "choose-cells-highest-free",
}


def in_process(fake_dists, capsys, row: str, source: str, target: str | None, args) -> subprocess.CompletedProcess:
    """`kvlayout *args` through `cli.main` here, with the row installed; as a CompletedProcess."""
    from kvlayout.cli import main

    install(fake_dists, row, source, target)
    capsys.readouterr()
    code = main(list(args))
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(args, code, out, err)


def one_line(done: subprocess.CompletedProcess) -> str:
    assert "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.splitlines()
    assert len(lines) == 1, done.stderr
    return lines[0]


def run_args(model_dir, *more: str) -> tuple[str, ...]:
    return ("run", "--model", str(model_dir), "--prompt", "hello", "--max-tokens", "4", "--json", *more)


@pytest.fixture(scope="module")
def registration_runs(tmp_path_factory, tiny_dir):
    """`kvlayout run --layout fake:x` with each row alone, and `plugins` / a default run with all of them."""
    calls = {}
    for row, (source, target, *_) in REGISTRATION.items():
        if row in SUBPROCESS:
            site = site_with(tmp_path_factory.mktemp(row), {row: (source, target)})
            calls[row] = (site, run_args(tiny_dir, "--layout", "fake:x"))
    everything = site_with(tmp_path_factory.mktemp("all"), {r: (v[0], v[1]) for r, v in REGISTRATION.items()})
    calls["plugins --json"] = (everything, ("plugins", "--json"))
    calls["plugins"] = (everything, ("plugins",))
    calls["default run"] = (everything, run_args(tiny_dir))
    return in_parallel(calls)


@pytest.mark.parametrize("row", REGISTRATION, ids=REGISTRATION)
def test_run_with_the_layout_of_a_skipped_plugin_says_why_in_one_line(request, tiny_dir, row):
    source, target, _, error, fragment, keys = REGISTRATION[row]
    if row in SUBPROCESS:
        done = request.getfixturevalue("registration_runs")[row]
    else:
        args = run_args(tiny_dir, "--layout", "fake:x")
        done = in_process(
            request.getfixturevalue("fake_dists"), request.getfixturevalue("capsys"), row, source, target, args
        )
    assert done.returncode == 2
    line = one_line(done)
    ep = "q" if target == "twice" else "p"
    if keys:
        assert line == (f"kvlayout: error: layout fake:x is not available: plugin 'p' from {dist_of(row)} 1.0 "
                        f"was skipped: {error}")
    else:
        assert line.startswith("kvlayout: error: no layout fake:x; available: ")
        assert "mlx:cell (kvlayout-cell 0.1.0), mlx:seq (kvlayout-seq 0.1.0)" in line
        assert f"; skipped: plugin '{ep}' from {dist_of(row)} 1.0 ({error or ''}" in line
        assert error is not None or fragment in line


def test_plugins_lists_every_skipped_plugin_and_exits_0(registration_runs):
    done = registration_runs["plugins --json"]
    assert done.returncode == 0 and done.stderr == ""
    payload = json.loads(done.stdout)
    assert {"mlx:cell", "mlx:seq", "fake:twice"} <= {f"{e['backend']}:{e['kind']}" for e in payload["layouts"]}
    failed = {f["distribution"]: f for f in payload["failed"]}
    for row, (_, target, hook_name, error, fragment, _) in REGISTRATION.items():
        f = failed[dist_of(row)]
        assert (f["entry_point"], f["version"], f["hook"]) == ("q" if target == "twice" else "p", "1.0", hook_name)
        assert f["error"] == error if error is not None else fragment in f["error"]
    table = registration_runs["plugins"]
    assert table.returncode == 0 and table.stderr == ""
    failed_lines = [line for line in table.stdout.splitlines() if line.startswith("failed ")]
    assert len(failed_lines) == len(REGISTRATION)
    assert "failed p from kvlayout-bad-builders-raises 1.0 in kvlayout_builders: kvlayout_builders raised " \
           "RuntimeError: boom in builders" in failed_lines


def test_a_run_of_another_layout_goes_on_saying_once_what_was_skipped(registration_runs):
    done = registration_runs["default run"]
    assert done.returncode == 0 and "Traceback" not in done.stderr
    skipped = [line for line in done.stderr.splitlines() if line.startswith("kvlayout: skipped plugin ")]
    assert len(skipped) == len(REGISTRATION)
    assert "kvlayout: skipped plugin 'p' from kvlayout-bad-misspelled-builders-hook 1.0: implements " \
           "kvlayout_builder, which is not a kvlayout hook; did you mean kvlayout_builders?" in skipped
    assert all(s["finish_reason"] == "length" for r in json.loads(done.stdout)["requests"] for s in r["samples"])


# -- a Builder's build and load ------------------------------------------------------------------

FACELESS = "class _C:\n    def as_batch_control(self):\n        raise RuntimeError('no face today')\n\n"
REFUSES = (
    "def _refuse(config):\n    from kvlayout import ConfigError\n"
    "    raise ConfigError('cache.capacity: this layout wants more')\n\n"
)

# row -> (source, the one line `kvlayout run --layout fake:x` prints after "kvlayout: error: ", recorded?)
BUILDERS = {
    "build-raises": (
        builders("[Builder('fake', 'x', _bad)]", "def _bad(config):\n    raise RuntimeError('build exploded')\n\n"),
        "plugin 'p' from {d} 1.0: layout fake:x: build() raised RuntimeError: build exploded", True),
    "build-returns-none": (
        builders("[Builder('fake', 'x', lambda config: None)]"),
        "plugin 'p' from {d} 1.0: layout fake:x: build() returned None: expected a cache", True),
    "build-calls-sys-exit": (
        builders("[Builder('fake', 'x', _bad)]", "def _bad(config):\n    import sys\n    sys.exit(5)\n\n"),
        "plugin 'p' from {d} 1.0: layout fake:x: build() raised SystemExit: 5", True),
    "build-returns-a-string": (
        builders("[Builder('fake', 'x', lambda config: 'a cache')]"),
        "layout fake:x ({d} 1.0) offers neither a batch nor a sequence control face; the runner cannot drive it",
        False),
    "build-returns-a-cache-whose-face-raises": (
        builders("[Builder('fake', 'x', lambda config: _C())]", FACELESS),
        "layout fake:x ({d} 1.0): its as_batch_control() raised RuntimeError: no face today", False),
    "build-refuses-the-config": (  # a layout's own refusal: the user's to fix, passed on as it is
        builders("[Builder('fake', 'x', _refuse)]", REFUSES), "cache.capacity: this layout wants more", False),
}


@pytest.fixture(scope="module")
def builder_runs(tmp_path_factory, tiny_dir):
    calls = {}
    for row, (source, *_) in BUILDERS.items():
        if row in SUBPROCESS:
            site = site_with(tmp_path_factory.mktemp(row), {row: (source, None)})
            calls[row] = (site, run_args(tiny_dir, "--layout", "fake:x"))
    return in_parallel(calls)


@pytest.mark.parametrize("row", BUILDERS, ids=BUILDERS)
def test_a_bad_build_is_one_line_naming_the_layout_and_its_distribution(request, tiny_dir, row):
    if row in SUBPROCESS:
        done = request.getfixturevalue("builder_runs")[row]
    else:
        args = run_args(tiny_dir, "--layout", "fake:x")
        done = in_process(
            request.getfixturevalue("fake_dists"), request.getfixturevalue("capsys"), row, BUILDERS[row][0], None, args
        )
    assert done.returncode == 2
    assert one_line(done) == "kvlayout: error: " + BUILDERS[row][1].format(d=dist_of(row))


@pytest.mark.parametrize("row", BUILDERS, ids=BUILDERS)
def test_a_bad_build_through_the_api_is_recorded_against_the_plugin(fake_dists, row):
    source, line, recorded = BUILDERS[row]
    dist = install(fake_dists, row, source)
    pm = make_plugin_manager()
    config = CacheConfig(capacity=8, n_layers=1, layers=[LayerConfig(1, 4)])
    try:
        registry.build("fake", "x", config, pm)
    except kvlayout.KVLayoutError as exc:
        assert str(exc) == line.format(d=dist)
        assert isinstance(exc, PluginError) == recorded
    else:
        assert not recorded  # a cache the registry cannot judge; the runner refuses it (above)
    failures = [(dist, "Builder.build", ("fake:x",))] if recorded else []
    assert [(f.distribution, f.hook, f.keys) for f in pm.failures] == failures
    assert registry.notices(pm) == []  # the layout is there; the error said why it failed
    assert resolve("mlx", "cell", pm).distribution == "kvlayout-cell"


LOADS = {
    "load-raises": ("def _l(state_file):\n    raise KeyError('k')\n\n", "load() raised KeyError: 'k'"),
    "load-returns-none": ("def _l(state_file):\n    return None\n\n", "load() returned None: expected a cache"),
}


@pytest.mark.parametrize("row", LOADS, ids=LOADS)
def test_a_bad_load_is_named_and_recorded(fake_dists, tmp_path, row):
    from kvlayout import persist

    before, reason = LOADS[row]
    dist = install(fake_dists, row, builders("[Builder('fake', 'x', _b, load=_l)]", before))
    pm = make_plugin_manager()
    config = CacheConfig(capacity=8, n_layers=1, layers=[LayerConfig(1, 4)])
    path = persist.save_state(tmp_path / "s.safetensors", layout="fake:x", content="cache", config=config, state={},
                              tensors={}, pm=pm)
    with pytest.raises(PluginError) as info:
        kvlayout.load(path, pm=pm)
    assert str(info.value) == f"plugin 'p' from {dist} 1.0: layout fake:x: {reason}"
    assert [(f.distribution, f.hook) for f in pm.failures] == [(dist, "Builder.load")]


# -- hooks during a step ---------------------------------------------------------------------------

# row -> (source, the hook named, the reason for a step of 2 tokens on a fresh 64-cell cache, or None
#         where it depends on the run, a warm-up step first?)
STEP_HOOKS = {
    # the items
    "choose-cells-repeats-a-cell": (
        hook("return [free[0]] * count"), "kvlayout_choose_cells",
        "kvlayout_choose_cells answered [0, 0]: expected 2 distinct cells from the free list (cell 0 more than once)"),
    "step-placed-raises": (
        hook("raise RuntimeError('observer exploded')", name="kvlayout_step_placed", args="step, window"),
        "kvlayout_step_placed", "kvlayout_step_placed raised RuntimeError: observer exploded"),
    # the other members of the class
    "choose-cells-raises": (
        hook("raise ValueError('policy exploded')"), "kvlayout_choose_cells",
        "kvlayout_choose_cells raised ValueError: policy exploded"),
    "choose-cells-calls-sys-exit": (
        hook("import sys\nsys.exit(6)"), "kvlayout_choose_cells", "kvlayout_choose_cells raised SystemExit: 6"),
    "choose-cells-too-few": (
        hook("return free[:count - 1]"), "kvlayout_choose_cells",
        "kvlayout_choose_cells answered [0]: expected 2 distinct cells from the free list (1 cell(s))"),
    "choose-cells-too-many": (
        hook("return free[:count + 1]"), "kvlayout_choose_cells",
        "kvlayout_choose_cells answered [0, 1, 2]: expected 2 distinct cells from the free list (3 cell(s))"),
    "choose-cells-floats": (
        hook("return free[:count].astype(float)"), "kvlayout_choose_cells",
        "kvlayout_choose_cells answered [0.0, 1.0]: expected 2 distinct cells from the free list "
        "(float64 values, not integers)"),
    "choose-cells-bools": (
        hook("return np.ones(count, bool)"), "kvlayout_choose_cells",
        "kvlayout_choose_cells answered [True, True]: expected 2 distinct cells from the free list "
        "(bool values, not integers)"),
    "choose-cells-out-of-range": (
        hook("return np.arange(count) + 10**9"), "kvlayout_choose_cells",
        "kvlayout_choose_cells answered [1000000000, 1000000001]: expected 2 distinct cells from the free list "
        "(cell 1000000000 is not free)"),
    "choose-cells-negative": (
        hook("return -np.arange(1, count + 1)"), "kvlayout_choose_cells",
        "kvlayout_choose_cells answered [-1, -2]: expected 2 distinct cells from the free list (cell -1 is not free)"),
    "choose-cells-a-scalar": (
        hook("return int(free[0])"), "kvlayout_choose_cells",
        "kvlayout_choose_cells answered 0: expected 2 distinct cells from the free list (a single int)"),
    "choose-cells-a-string": (
        hook("return 'cells'"), "kvlayout_choose_cells",
        "kvlayout_choose_cells answered 'cells': expected 2 distinct cells from the free list (a single str)"),
    "choose-cells-2-d": (
        hook("return free[:count][None]"), "kvlayout_choose_cells",
        "kvlayout_choose_cells answered [[0, 1]]: expected 2 distinct cells from the free list (a 2-d array)"),
    "choose-cells-sorts-free-in-place": (
        hook("free.sort()\nreturn free[:count]"), "kvlayout_choose_cells",
        "kvlayout_choose_cells raised ValueError: sort array is read-only"),
    "choose-cells-answers-taken-cells": (  # the first step's answer is right; the same cells again are not
        hook("return np.arange(count)"), "kvlayout_choose_cells",
        "kvlayout_choose_cells answered [0, 1]: expected 2 distinct cells from the free list (cell 0 is not free)"),
    "step-placed-writes-to-the-step": (
        hook("step.cells[0] = 0", name="kvlayout_step_placed", args="step, window"), "kvlayout_step_placed",
        "kvlayout_step_placed raised ValueError: assignment destination is read-only"),
    "step-placed-raises-on-the-ring-window": (
        hook("if window:\n    raise RuntimeError('ring observer')", name="kvlayout_step_placed", args="step, window"),
        "kvlayout_step_placed", "kvlayout_step_placed raised RuntimeError: ring observer"),
}
RING_ROWS = {"step-placed-raises-on-the-ring-window"}
WARM_ROWS = {"choose-cells-answers-taken-cells"}

# Plugins that behave: the run is the one with no plugin, token for token.
GOOD_HOOKS = {
    "choose-cells-abstains": hook("return None"),
    "choose-cells-highest-free": hook("return free[::-1][:count]"),
    "step-placed-returns-a-value": hook("return 42", name="kvlayout_step_placed", args="step, window"),
    "step-aborted-observer": hook("pass", name="kvlayout_step_aborted", args="step, window"),
}


def cell_cache(pm, ring=False):
    from kvlayout_cell.cache import CellCache

    flat = LayerConfig(1, 4)
    layers = [flat, LayerConfig(1, 4, policy={"kind": "ring", "window": 4})] if ring else [flat]
    return CellCache(CacheConfig(capacity=64, n_layers=2, layers=layers, kv_dtype="float32"), pm=pm)


def table_state(cache, ids) -> tuple:
    """What a caller can see of the cell table, read straight from it."""
    t = cache.groups.primary.table
    cells, pos, owners = t.occupied()
    per_id = tuple((t.seq_len(s), t.next_pos(s)) for s in ids)
    return (
        t.free_list().tolist(), t.used_end, cells.tolist(), pos.tolist(), owners.tolist(), t.live_ids().tolist(), per_id
    )


KV = mx.zeros((1, 1, 2, 4))


@pytest.mark.parametrize("row", STEP_HOOKS, ids=STEP_HOOKS)
def test_a_misbehaving_hook_refuses_the_step_naming_the_plugin_and_changes_nothing(fake_dists, row):
    source, hook_name, reason = STEP_HOOKS[row]
    dist = install(fake_dists, row, source)
    pm = make_plugin_manager()
    cache = cell_cache(pm, ring=row in RING_ROWS)
    bc = cache.as_batch_control()
    s = bc.seq_new()
    positions = [0, 1]
    if row in WARM_ROWS:
        assert bc.declare_step([s, s])
        for layer in range(2):
            cache.update_and_fetch(layer, positions, KV, KV)
        positions = [2, 3]
    assert bc.declare_step([s, s])
    refused_at = 1 if row in RING_ROWS else 0
    for layer in range(refused_at):
        cache.update_and_fetch(layer, positions, KV, KV)
    before = table_state(cache, [s])
    with pytest.raises(PluginStepError) as info:
        cache.update_and_fetch(refused_at, positions, KV, KV)
    assert str(info.value) == f"plugin 'p' from {dist} 1.0: {reason}"
    assert (info.value.distribution, info.value.hook) == (dist, hook_name)
    assert isinstance(info.value, StepError)
    assert table_state(cache, [s]) == before  # the refused call changed nothing
    # ... so the same call succeeds once the plugin is gone: the declaration (or the placement) stood.
    pm.unregister(name=f"{dist}:p")
    for layer in range(refused_at, 2):
        cache.update_and_fetch(layer, positions, KV, KV)
    assert bc.next_pos(s) == positions[-1] + 1 and bc.seq_len(s) == positions[-1] + 1


def test_an_observer_of_an_abort_that_raises_is_named_and_the_abort_happens(fake_dists):
    dist = install(fake_dists, "step-aborted-raises",
                   hook("raise RuntimeError('abort observer exploded')",
                        name="kvlayout_step_aborted", args="step, window"))
    cache = cell_cache(make_plugin_manager(), ring=True)
    bc = cache.as_batch_control()
    s = bc.seq_new()
    before = table_state(cache, [s])
    assert bc.declare_step([s, s])
    for layer in range(2):
        cache.update_and_fetch(layer, [0, 1], KV, KV)
    with pytest.raises(PluginStepError) as info:
        cache.abort_step()
    assert str(info.value) == (
        f"plugin 'p' from {dist} 1.0: kvlayout_step_aborted raised RuntimeError: abort observer exploded"
    )
    assert table_state(cache, [s]) == before  # aborted all the same
    assert cache.abort_step() is False  # and nothing is left open


def test_every_window_is_announced_aborted_even_when_an_observer_of_the_first_raises():
    from kvlayout import hookimpl

    heard = []

    class Flaky:
        @hookimpl
        def kvlayout_step_aborted(self, step, window):
            heard.append(window)
            if window == 0:
                raise RuntimeError("first window")

    pm = make_plugin_manager()
    pm.register(Flaky(), name="flaky")
    cache = cell_cache(pm, ring=True)
    bc = cache.as_batch_control()
    s = bc.seq_new()
    assert bc.declare_step([s, s])
    for layer in range(2):
        cache.update_and_fetch(layer, [0, 1], KV, KV)
    with pytest.raises(PluginStepError, match="kvlayout_step_aborted raised RuntimeError: first window"):
        cache.abort_step()
    assert sorted(heard) == [0, 4]


def test_observers_hear_a_refused_window_taken_back(fake_dists):
    from kvlayout import hookimpl

    class Ledger:  # a policy's own record of where tokens landed, as a paged allocator keeps
        def __init__(self):
            self.held = {}

        @hookimpl
        def kvlayout_step_placed(self, step, window):
            self.held[window] = self.held.get(window, 0) + step.length

        @hookimpl
        def kvlayout_step_aborted(self, step, window):
            self.held[window] -= step.length

    install(fake_dists, "ring-observer", STEP_HOOKS["step-placed-raises-on-the-ring-window"][0])
    pm = make_plugin_manager()
    ledger = Ledger()
    pm.register(ledger, name="ledger")
    cache = cell_cache(pm, ring=True)
    bc = cache.as_batch_control()
    s = bc.seq_new()
    assert bc.declare_step([s, s])
    cache.update_and_fetch(0, [0, 1], KV, KV)
    with pytest.raises(PluginStepError):
        cache.update_and_fetch(1, [0, 1], KV, KV)
    assert ledger.held == {0: 2, 4: 0}  # it heard the ring window placed (whatever the order), then taken back
    cache.abort_step()
    assert ledger.held == {0: 0, 4: 0}


def test_a_restored_sequence_refused_by_an_observer_leaves_no_cell_and_no_id(fake_dists, tmp_path):
    source = STEP_HOOKS["step-placed-raises"][0]
    src = cell_cache(make_plugin_manager())
    bc = src.as_batch_control()
    s = bc.seq_new()
    assert bc.declare_step([s, s])
    for layer in range(2):
        src.update_and_fetch(layer, [0, 1], KV, KV)
    path = src.save_seq(s, tmp_path / "seq.safetensors")
    dist = install(fake_dists, "observer-of-restores", source)
    dst = cell_cache(make_plugin_manager())
    before = table_state(dst, range(4))
    with pytest.raises(PluginStepError, match=f"^plugin 'p' from {dist} 1.0: kvlayout_step_placed raised"):
        dst.load_seq(path)
    assert table_state(dst, range(4)) == before


# -- the same hooks through `kvlayout run` ----------------------------------------------------------


@pytest.fixture(scope="module")
def hook_runs(tmp_path_factory, tiny_dir, ring_dir):
    calls = {"no plugin": (None, run_args(tiny_dir))}
    for row, source in {**{r: v[0] for r, v in STEP_HOOKS.items()}, **GOOD_HOOKS}.items():
        if row in SUBPROCESS:
            model = ring_dir if row in RING_ROWS else tiny_dir
            calls[row] = (site_with(tmp_path_factory.mktemp(row), {row: (source, None)}), run_args(model))
    return in_parallel(calls)


def hook_run(request, row: str, source: str) -> subprocess.CompletedProcess:
    if row in SUBPROCESS:
        return request.getfixturevalue("hook_runs")[row]
    model = request.getfixturevalue("ring_dir" if row in RING_ROWS else "tiny_dir")
    return in_process(
        request.getfixturevalue("fake_dists"), request.getfixturevalue("capsys"), row, source, None, run_args(model)
    )


@pytest.mark.parametrize("row", STEP_HOOKS, ids=STEP_HOOKS)
def test_run_fails_the_samples_of_a_misbehaving_hook_says_why_once_and_exits_1(request, row):
    source, hook_name, reason = STEP_HOOKS[row]
    done = hook_run(request, row, source)
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("kvlayout: error")]
    assert len(errors) == 1, done.stderr
    prefix = f"kvlayout: error: 1 of 1 samples failed: plugin 'p' from {dist_of(row)} 1.0: {hook_name} "
    assert errors[0].startswith(prefix), errors[0]
    assert "array(" not in errors[0]
    out = json.loads(done.stdout)
    [sample] = [s for r in out["requests"] for s in r["samples"]]
    assert sample["finish_reason"] == "error" and errors[0] == (
        f"kvlayout: error: 1 of 1 samples failed: {sample['error']}"
    )
    assert out["stats"]["failed_forwards"] == 1  # a plugin's fault is not retried as a transient failure
    if row not in WARM_ROWS:
        assert sample["token_ids"] == []


@pytest.mark.parametrize("row", GOOD_HOOKS, ids=GOOD_HOOKS)
def test_run_with_a_plugin_that_behaves_gives_the_tokens_of_a_run_without_it(request, hook_runs, row):
    done, alone = hook_run(request, row, GOOD_HOOKS[row]), hook_runs["no plugin"]
    assert done.returncode == alone.returncode == 0
    assert done.stderr == alone.stderr  # the one notice (no chat template), nothing else
    ids = lambda d: [s["token_ids"] for r in json.loads(d.stdout)["requests"] for s in r["samples"]]  # noqa: E731
    assert ids(done) == ids(alone) and len(ids(alone)[0]) == 4


def test_an_abort_observer_that_raises_fails_the_step_it_could_have_retried(fake_dists, tiny_loaded, tiny_dir):
    """A transient forward failure would be retried; the abort's observer raising makes it a plugin's fault."""
    from kvlayout.runner import job
    from tests.runner.conftest import make_config

    dist = install(fake_dists, "abort-observer",
                   hook("raise RuntimeError('abort observer exploded')",
                        name="kvlayout_step_aborted", args="step, window"))
    model, args, tok, name = tiny_loaded
    calls = []

    class FailsAtLayer1:  # the first forward writes layer 0, then runs out of memory
        def __init__(self, cache):
            self.cache = cache

        def update_and_fetch(self, layer, positions, k, v):
            if layer == 1:
                raise MemoryError("transient")
            return self.cache.update_and_fetch(layer, positions, k, v)

    def fails_once(tokens, positions, cache, rows=None):
        calls.append(len(tokens))
        return model(tokens, positions, FailsAtLayer1(cache) if len(calls) == 1 else cache, rows=rows)

    cfg = make_config(tiny_dir, requests=[{"prompt": "hello", "max_tokens": 3}])
    result = job.prepare(cfg, loaded=(fails_once, args, tok, name)).generate()
    [sample] = result.outputs[0]
    assert sample.finish_reason == "error"
    assert sample.error == (
        f"plugin 'p' from {dist} 1.0: kvlayout_step_aborted raised RuntimeError: abort observer exploded"
    )
    assert calls == [len(tok.encode("hello"))] and result.stats.failed_forwards == 1  # not retried


FLAKY_LAYOUT = HEAD + '''
import kvlayout


class _Flaky:
    """mlx:seq underneath, but every forward fails at its first layer: a layout's bug, not a hook's."""

    def __init__(self, config):
        self.inner = kvlayout.build("mlx", "seq", config)

    def as_batch_control(self):
        return None

    def as_control(self):
        return self.inner.as_control()

    def abort_step(self):
        return self.inner.abort_step()

    def update_and_fetch(self, layer, positions, k, v):
        raise RuntimeError("the layout lost its pool")


@hookimpl
def kvlayout_builders():
    return [Builder("fake", "flaky", _Flaky)]
'''


def test_a_failure_that_may_be_transient_is_retried_and_still_exits_1(fake_dists, capsys, tiny_dir):
    args = run_args(tiny_dir, "--layout", "fake:flaky")
    done = in_process(fake_dists, capsys, "flaky-layout", FLAKY_LAYOUT, None, args)
    assert done.returncode == 1
    errors = [line for line in done.stderr.splitlines() if line.startswith("kvlayout: error")]
    assert errors == ["kvlayout: error: 1 of 1 samples failed: RuntimeError: the layout lost its pool"]
    assert json.loads(done.stdout)["stats"]["failed_forwards"] == 2  # tried, then retried once
