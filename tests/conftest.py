"""Shared fixtures.

`fake_dists` puts real distribution metadata on `sys.path`: a `*.dist-info`
directory (METADATA + entry_points.txt with a `[kvlayout]` group) next to the
plugin's module file, exactly what `pip install` leaves behind, so
`importlib.metadata.entry_points(group="kvlayout")` finds it the way it finds
an installed plugin.
"""

from __future__ import annotations

import importlib
import os
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from kvlayout import registry
from kvlayout.runner import blas

# The `kvlayout` commands tests call in this process (main(argv)) must never re-execute it with another
# BLAS preloaded (kvlayout.runner.blas.ensure): the choice counts as made here, the bundled BLAS kept.
# Subprocesses (tests.helpers.cli_env) drop the mark and choose as a user's command does.
os.environ[blas.CHOSEN] = "none"


class FakeDists:
    """Writes fake installed distributions under one directory on sys.path."""

    def __init__(self, root: Path):
        self.root = root
        self.modules: list[str] = []

    def add(self, name: str, version: str, entry_points: dict[str, str], modules: dict[str, str]) -> None:
        """Install distribution `name` `version`: `entry_points` maps entry-point name to
        "module" or "module:attr" in the group `kvlayout`; `modules` maps a module name
        to its source."""
        info = self.root / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        lines = ["[kvlayout]"] + [f"{ep} = {target}" for ep, target in entry_points.items()]
        (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
        for module, source in modules.items():
            (self.root / f"{module}.py").write_text(textwrap.dedent(source))
            self.modules.append(module)
        importlib.invalidate_caches()


@pytest.fixture
def fake_dists(tmp_path, monkeypatch) -> FakeDists:
    """An empty site directory prepended to sys.path; fake plugins go in with `.add()`.

    Teardown drops the fake modules from sys.modules and the cached plugin
    manager, so no other test sees them.
    """
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.delenv("KVLAYOUT_STRICT", raising=False)
    registry.plugin_manager.cache_clear()
    dists = FakeDists(site)
    yield dists
    for module in dists.modules:
        sys.modules.pop(module, None)
    importlib.invalidate_caches()
    registry.plugin_manager.cache_clear()


GOOD_PLUGIN = """
    from kvlayout import Builder, hookimpl

    def build_good(config):
        return ("good cache", config)

    @hookimpl
    def kvlayout_builders():
        return [Builder("fake", "good", build_good, "a layout that works")]
"""

BROKEN_PLUGIN = """
    raise ImportError("kvl_fake_broken cannot find its native library")
"""


def dup_plugin(tag: str) -> str:
    return f"""
    from kvlayout import Builder, hookimpl

    @hookimpl
    def kvlayout_builders():
        return [Builder("fake", "dup", lambda config: {tag!r}, "one of two claims")]
"""


@pytest.fixture
def plugin_world(fake_dists) -> FakeDists:
    """A good plugin (fake:good), a broken one, and two distributions both claiming fake:dup."""
    fake_dists.add("kvlayout-fake-good", "1.2.3", {"good": "kvl_fake_good"}, {"kvl_fake_good": GOOD_PLUGIN})
    fake_dists.add("kvlayout-fake-broken", "0.0.1", {"broken": "kvl_fake_broken"}, {"kvl_fake_broken": BROKEN_PLUGIN})
    fake_dists.add("kvlayout-fake-dup-a", "1.0", {"dup_a": "kvl_fake_dup_a"}, {"kvl_fake_dup_a": dup_plugin("a")})
    fake_dists.add("kvlayout-fake-dup-b", "2.0", {"dup_b": "kvl_fake_dup_b"}, {"kvl_fake_dup_b": dup_plugin("b")})
    return fake_dists


@pytest.fixture
def rng() -> np.random.Generator:
    """A seeded generator, so every test's random data is reproducible."""
    return np.random.default_rng(0)


# -- hypothesis profiles -------------------------------------------------------
# "ci" is the default: the stateful machines (tests/*/test_stateful.py) run
# 200 examples of up to 30 steps each. `pytest --hypothesis-profile=long`
# (hypothesis's own pytest option) runs 5000 examples of up to 60 steps.
# An explicit @settings on a test still wins over the profile.
# -- model directories every model-level test shares (tiny preset; a ring variant) --


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory) -> Path:
    from kvlayout.models.presets import write_preset

    return write_preset(tmp_path_factory.mktemp("tiny"), "tiny")


@pytest.fixture(scope="session")
def ring_dir(tmp_path_factory) -> Path:
    """The tiny model with a sliding window on its first layer (HF layer_types)."""
    from kvlayout.models.presets import write_preset

    return write_preset(
        tmp_path_factory.mktemp("ring"),
        "tiny",
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
    )


@pytest.fixture(scope="session")
def tiny_loaded(tiny_dir):
    from kvlayout.models.loading import load_model

    model, args, tok = load_model(tiny_dir)
    return model, args, tok, str(tiny_dir)


@pytest.fixture(scope="session")
def ring_loaded(ring_dir):
    from kvlayout.models.loading import load_model

    model, args, tok = load_model(ring_dir)
    return model, args, tok, str(ring_dir)


from hypothesis import settings as _hypothesis_settings  # noqa: E402

_hypothesis_settings.register_profile("ci", max_examples=200, stateful_step_count=30, deadline=None)
_hypothesis_settings.register_profile("long", max_examples=5000, stateful_step_count=60, deadline=None)
_hypothesis_settings.load_profile("ci")
