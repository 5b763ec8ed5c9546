"""Discovery through real entry points: fake distributions' dist-info on sys.path.

The `plugin_world` fixture (tests/conftest.py) installs kvlayout-fake-good
(fake:good), kvlayout-fake-broken (raises on import), and kvlayout-fake-dup-a /
kvlayout-fake-dup-b (both claim fake:dup). Whatever real plugins are installed
may be found too; these tests only look at the fakes.
"""

from __future__ import annotations

import pytest

import kvlayout
from kvlayout import Builder, DuplicateLayout, LayoutNotFound, PluginError, hookimpl, registry
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


def test_a_broken_plugin_is_recorded_and_skipped_and_said_once_by_whoever_runs(plugin_world, capsys):
    pm = make_plugin_manager()
    assert capsys.readouterr().err == ""  # a library prints nothing; a command says it (registry.notices)
    [failure] = [f for f in pm.failures if f.distribution == "kvlayout-fake-broken"]
    assert (failure.entry_point, failure.version, failure.hook) == ("broken", "0.0.1", None)
    assert failure.error == "ImportError: kvl_fake_broken cannot find its native library"
    assert not pm.has_plugin("kvlayout-fake-broken:broken")
    assert resolve("fake", "good", pm).distribution == "kvlayout-fake-good"  # the others still load
    assert registry.notices(pm) == [
        "skipped plugin 'broken' from kvlayout-fake-broken 0.0.1: "
        "ImportError: kvl_fake_broken cannot find its native library"
    ]


def test_a_missing_key_names_the_plugins_that_were_skipped(plugin_world):
    with pytest.raises(LayoutNotFound) as info:
        resolve("fake", "broken", make_plugin_manager())
    assert str(info.value).endswith(
        "; skipped: plugin 'broken' from kvlayout-fake-broken 0.0.1 "
        "(ImportError: kvl_fake_broken cannot find its native library)"
    )


@pytest.mark.parametrize("how", ["env", "argument"])
def test_strict_mode_raises_naming_the_broken_plugin(plugin_world, monkeypatch, how):
    if how == "env":
        monkeypatch.setenv("KVLAYOUT_STRICT", "1")
        make = make_plugin_manager
    else:
        make = lambda: make_plugin_manager(strict=True)  # noqa: E731
    with pytest.raises(PluginError, match="'broken' from kvlayout-fake-broken 0.0.1 failed to load") as info:
        make()
    assert "cannot find its native library" in str(info.value)
    assert isinstance(info.value.__cause__, ImportError)
    assert info.value.distribution == "kvlayout-fake-broken"


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


def test_a_plugin_returning_something_else_than_builders_is_skipped_and_named(fake_dists):
    from tests.conftest import GOOD_PLUGIN

    fake_dists.add(
        "kvlayout-fake-odd", "3.0", {"odd": "kvl_fake_odd"},
        {"kvl_fake_odd": "from kvlayout import hookimpl\n\n@hookimpl\n"
                         "def kvlayout_builders():\n    return ['fake:odd']\n"},
    )
    fake_dists.add("kvlayout-fake-good", "1.2.3", {"good": "kvl_fake_good"}, {"kvl_fake_good": GOOD_PLUGIN})
    pm = make_plugin_manager()
    [failure] = [f for f in pm.failures if f.distribution == "kvlayout-fake-odd"]
    assert (failure.entry_point, failure.version, failure.hook) == ("odd", "3.0", "kvlayout_builders")
    assert failure.error == "kvlayout_builders returned 'fake:odd' among its records: expected Builder records"
    assert not pm.has_plugin("kvlayout-fake-odd:odd")
    assert [b.key for b in fakes(available(pm))] == ["fake:good"]  # the others are untouched


def test_a_plugin_registered_directly_with_a_misspelled_hook_is_refused_and_not_registered():
    class Misspelled:
        @hookimpl
        def kvlayout_builder(self):
            return []

    pm = make_plugin_manager(entry_points=False)
    with pytest.raises(PluginError, match=r"^plugin 'Misspelled': implements kvlayout_builder, which is not a "
                                          r"kvlayout hook; did you mean kvlayout_builders\?$"):
        pm.register(Misspelled())
    assert pm.plugins() == []
    pm.check_pending()  # nothing of it is left pending


def test_a_hook_nothing_like_any_kvlayout_hook_lists_them_all():
    class Alien:
        @hookimpl
        def pytest_configure(self):
            pass

    with pytest.raises(PluginError, match="kvlayout's hooks are kvlayout_builders, kvlayout_choose_cells, "
                                          "kvlayout_step_aborted, kvlayout_step_placed"):
        make_plugin_manager(entry_points=False).register(Alien(), name="alien")


def test_a_builder_s_build_that_raises_or_returns_none_is_named_and_recorded():
    class Bad:
        @hookimpl
        def kvlayout_builders(self):
            return [Builder("t", "raises", lambda c: 1 / 0), Builder("t", "none", lambda c: None),
                    Builder("t", "refuses", self.refuse)]

        @staticmethod
        def refuse(config):
            raise kvlayout.ConfigError("capacity: expected more")

    pm = make_plugin_manager(entry_points=False)
    pm.register(Bad(), name="kvlayout-bad:bad")
    pm.provenance["kvlayout-bad:bad"] = ("kvlayout-bad", "0.2")
    with pytest.raises(PluginError) as info:
        build("t", "raises", "cfg", pm)
    assert str(info.value) == (
        "plugin 'bad' from kvlayout-bad 0.2: layout t:raises: build() raised ZeroDivisionError: division by zero"
    )
    assert (info.value.distribution, info.value.hook) == ("kvlayout-bad", "Builder.build")
    assert isinstance(info.value.__cause__, ZeroDivisionError)
    with pytest.raises(PluginError, match=r"layout t:none: build\(\) returned None: expected a cache"):
        build("t", "none", "cfg", pm)
    with pytest.raises(kvlayout.ConfigError, match="^capacity: expected more$"):  # the layout's own refusal
        build("t", "refuses", "cfg", pm)
    assert [(f.entry_point, f.distribution, f.hook, f.keys) for f in pm.failures] == [
        ("bad", "kvlayout-bad", "Builder.build", ("t:raises",)),
        ("bad", "kvlayout-bad", "Builder.build", ("t:none",)),
    ]
    assert registry.notices(pm) == []  # nothing was skipped: the layouts are there, and each failure said why


def test_plugins_lists_every_registered_plugin_with_its_hooks(fake_dists):
    fake_dists.add(
        "kvlayout-fake-watch", "0.3", {"watch": "kvl_fake_watch"},
        {"kvl_fake_watch": "from kvlayout import hookimpl\n\n@hookimpl\ndef kvlayout_step_placed(step, window):\n"
                           "    pass\n\n@hookimpl\ndef kvlayout_step_aborted(window):\n    pass\n"},
    )
    pm = make_plugin_manager()
    [watch] = [p for p in pm.plugins() if p.distribution == "kvlayout-fake-watch"]
    assert (watch.name, watch.version, watch.hooks) == (
        "watch", "0.3", ("kvlayout_step_aborted", "kvlayout_step_placed")
    )
    assert fakes(available(pm)) == []  # a plugin with no layout is still a plugin


def test_duplicates_lists_each_key_claimed_twice_with_its_claimants(plugin_world):
    dups = registry.duplicates(available(make_plugin_manager()))
    assert {k: [b.distribution for b in bs] for k, bs in dups.items() if k.startswith("fake:")} == {
        "fake:dup": ["kvlayout-fake-dup-a", "kvlayout-fake-dup-b"]
    }


def test_a_plugin_with_no_builders_contributes_nothing(fake_dists):
    fake_dists.add(
        "kvlayout-fake-empty", "0.1", {"empty": "kvl_fake_empty"},
        {"kvl_fake_empty": "from kvlayout import hookimpl\n\n@hookimpl\ndef kvlayout_builders():\n    return []\n"},
    )
    pm = make_plugin_manager()
    assert pm.provenance["kvlayout-fake-empty:empty"] == ("kvlayout-fake-empty", "0.1")
    assert fakes(available(pm)) == []
