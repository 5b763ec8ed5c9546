"""Discovery through real entry points: fake distributions' dist-info on sys.path.

The `plugin_world` fixture (tests/conftest.py) installs kvlayout-fake-good
(fake:good), kvlayout-fake-broken (raises on import), and kvlayout-fake-dup-a /
kvlayout-fake-dup-b (both claim fake:dup). Whatever real plugins are installed
may be found too; these tests only look at the fakes.
"""

from __future__ import annotations

import pytest

import kvlayout
from kvlayout import Builder, DuplicateLayout, KVLayoutError, LayoutNotFound, registry
from kvlayout.registry import available, build, make_plugin_manager, resolve


def fakes(builders):
    return [b for b in builders if b.backend_id == "fake"]


def test_a_good_plugin_is_resolved_and_tagged_with_its_distribution(plugin_world):
    pm = make_plugin_manager()
    builder = resolve("fake", "good", pm)
    assert isinstance(builder, Builder)
    assert (builder.key, builder.distribution, builder.version) == ("fake:good", "kvlayout-fake-good", "1.2.3")
    assert builder.summary == "a layout that works"
    assert pm.provenance["kvlayout-fake-good:good"] == ("kvlayout-fake-good", "1.2.3")


def test_available_lists_every_fake_builder_with_its_provider(plugin_world):
    found = [(b.key, b.distribution, b.version) for b in fakes(available(make_plugin_manager()))]
    assert found == [
        ("fake:dup", "kvlayout-fake-dup-a", "1.0"),
        ("fake:dup", "kvlayout-fake-dup-b", "2.0"),
        ("fake:good", "kvlayout-fake-good", "1.2.3"),
    ]


def test_a_broken_plugin_is_reported_on_stderr_and_skipped(plugin_world, capsys):
    pm = make_plugin_manager()
    err = capsys.readouterr().err
    assert "'broken'" in err and "kvlayout-fake-broken" in err and "cannot find its native library" in err
    [failure] = [f for f in pm.failures if f.distribution == "kvlayout-fake-broken"]
    assert (failure.entry_point, failure.version) == ("broken", "0.0.1")
    assert failure.error.startswith("ImportError")
    assert not pm.has_plugin("kvlayout-fake-broken:broken")
    assert resolve("fake", "good", pm).distribution == "kvlayout-fake-good"  # the others still load


@pytest.mark.parametrize("how", ["env", "argument"])
def test_strict_mode_raises_naming_the_broken_plugin(plugin_world, monkeypatch, how):
    if how == "env":
        monkeypatch.setenv("KVLAYOUT_STRICT", "1")
        make = make_plugin_manager
    else:
        make = lambda: make_plugin_manager(strict=True)  # noqa: E731
    with pytest.raises(KVLayoutError, match="'broken' from kvlayout-fake-broken 0.0.1") as info:
        make()
    assert "cannot find its native library" in str(info.value)
    assert isinstance(info.value.__cause__, ImportError)


def test_strict_false_overrides_the_environment(plugin_world, monkeypatch):
    monkeypatch.setenv("KVLAYOUT_STRICT", "1")
    pm = make_plugin_manager(strict=False)
    assert any(f.distribution == "kvlayout-fake-broken" for f in pm.failures)


def test_strict_zero_in_the_environment_is_not_strict(plugin_world, monkeypatch):
    monkeypatch.setenv("KVLAYOUT_STRICT", "0")
    assert resolve("fake", "good", make_plugin_manager()).key == "fake:good"


def test_a_key_claimed_by_two_distributions_raises_naming_both(plugin_world):
    pm = make_plugin_manager()
    with pytest.raises(DuplicateLayout) as info:
        resolve("fake", "dup", pm)
    message = str(info.value)
    assert "fake:dup" in message
    assert "kvlayout-fake-dup-a 1.0" in message and "kvlayout-fake-dup-b 2.0" in message
    with pytest.raises(DuplicateLayout):
        build("fake", "dup", object(), pm)  # never last-one-wins


def test_a_duplicate_does_not_block_other_keys(plugin_world):
    assert resolve("fake", "good", make_plugin_manager()).key == "fake:good"


def test_a_missing_key_lists_what_is_available_and_suggests_close_matches(plugin_world):
    pm = make_plugin_manager()
    with pytest.raises(LayoutNotFound) as info:
        resolve("fake", "godo", pm)
    message = str(info.value)
    assert isinstance(info.value, LookupError)
    assert "no layout fake:godo" in message
    assert "fake:good (kvlayout-fake-good 1.2.3)" in message
    assert "fake:dup (kvlayout-fake-dup-a 1.0)" in message and "fake:dup (kvlayout-fake-dup-b 2.0)" in message
    assert "did you mean fake:good" in message


def test_a_missing_key_far_from_everything_gets_no_suggestion(plugin_world):
    with pytest.raises(LayoutNotFound) as info:
        resolve("zzzzzzzzzzzz", "qqqqqqqqqq", make_plugin_manager())
    assert "did you mean" not in str(info.value)


def test_a_missing_key_with_nothing_installed_says_so():
    pm = make_plugin_manager(entry_points=False)
    with pytest.raises(LayoutNotFound, match="none installed"):
        resolve("mlx", "paged", pm)


def test_build_calls_the_builder_with_the_config(plugin_world):
    config = kvlayout.CacheConfig(capacity=8, n_layers=1, layers=[kvlayout.LayerConfig(1, 8)])
    assert build("fake", "good", config, make_plugin_manager()) == ("good cache", config)


def test_the_module_functions_use_the_cached_manager(plugin_world):
    pm = registry.plugin_manager()
    assert registry.plugin_manager() is pm
    assert kvlayout.plugin_manager is registry.plugin_manager
    assert kvlayout.resolve("fake", "good").distribution == "kvlayout-fake-good"
    assert [b.key for b in fakes(kvlayout.available())] == ["fake:dup", "fake:dup", "fake:good"]
    assert kvlayout.build("fake", "good", "cfg") == ("good cache", "cfg")


def test_a_fresh_manager_sees_a_plugin_installed_after_the_cached_one(fake_dists):
    from tests.conftest import GOOD_PLUGIN

    before = registry.plugin_manager()
    fake_dists.add("kvlayout-fake-good", "1.2.3", {"good": "kvl_fake_good"}, {"kvl_fake_good": GOOD_PLUGIN})
    assert not fakes(available(before))  # loaded once, as documented
    assert fakes(available(make_plugin_manager()))[0].key == "fake:good"


def test_a_plugin_returning_something_else_than_builders_is_named(fake_dists):
    fake_dists.add(
        "kvlayout-fake-odd", "3.0", {"odd": "kvl_fake_odd"},
        {"kvl_fake_odd": "from kvlayout import hookimpl\n\n@hookimpl\ndef kvlayout_builders():\n    return ['fake:odd']\n"},
    )
    with pytest.raises(KVLayoutError, match="kvlayout-fake-odd:odd.*expected Builder"):
        available(make_plugin_manager())


def test_a_plugin_with_no_builders_contributes_nothing(fake_dists):
    fake_dists.add(
        "kvlayout-fake-empty", "0.1", {"empty": "kvl_fake_empty"},
        {"kvl_fake_empty": "from kvlayout import hookimpl\n\n@hookimpl\ndef kvlayout_builders():\n    return []\n"},
    )
    pm = make_plugin_manager()
    assert pm.provenance["kvlayout-fake-empty:empty"] == ("kvlayout-fake-empty", "0.1")
    assert fakes(available(pm)) == []
