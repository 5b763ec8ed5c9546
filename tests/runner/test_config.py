"""The runner's TOML config: the embedded default, and errors that name the key."""

from __future__ import annotations

import pytest

from kvlayout.errors import ConfigError
from kvlayout.runner.config import RunConfig, load_config


def test_the_embedded_default_is_smollm2_chatting_falling_back_to_tiny_with_requests_sharing_a_system_prompt():
    cfg = load_config(None)
    assert (cfg.model.preset, cfg.model.fallback, cfg.layout.key) == ("smollm2", "tiny", "mlx:cell")
    assert len(cfg.requests) >= 3 and all(r.n == 2 and r.messages for r in cfg.requests)
    systems = {r.messages[0] for r in cfg.requests}
    assert len(systems) == 1 and systems.pop().role == "system"
    assert len({r.messages[-1].content for r in cfg.requests}) == len(cfg.requests)
    assert not cfg.plain_chat  # only a fallback taken turns it on


def test_messages_and_stop_strings_are_read():
    cfg = RunConfig.from_mapping(_mapping(requests=[{
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
        "stop": ["\n\n", "Q:"],
    }]))
    (r,) = cfg.requests
    assert [(m.role, m.content) for m in r.messages] == [("system", "Be brief."), ("user", "Hi")]
    assert r.stop == ("\n\n", "Q:") and r.prompt is None


def test_plain_chat_is_not_a_key_a_config_can_set():
    with pytest.raises(ConfigError, match="unknown key 'plain_chat'"):
        RunConfig.from_mapping(_mapping(plain_chat=True))


def _mapping(**over):
    data = {"model": {"preset": "tiny"}, "requests": [{"prompt": "hi", "max_tokens": 4}]}
    data.update(over)
    return data


@pytest.mark.parametrize(
    "data, key",
    [
        (_mapping(cache={"capcity": 10}), "cache.capcity"),
        (_mapping(sampling={"temp": 1.0}), "sampling.temp"),
        (_mapping(modle={}), "modle"),
        (_mapping(requests=[{"prompt": "hi", "max_token": 3}]), "requests[0].max_token"),
    ],
)
def test_an_unknown_key_is_named_with_the_valid_ones(data, key):
    with pytest.raises(ConfigError) as info:
        RunConfig.from_mapping(data, source="x.toml")
    assert f"unknown key '{key}'; valid keys" in str(info.value)


@pytest.mark.parametrize(
    "data, needle",
    [
        (_mapping(cache={"capacity": 0}), "cache.capacity=0"),
        (_mapping(cache={"kv_dtype": "int8"}), "cache.kv_dtype='int8'"),
        (_mapping(sampling={"top_p": 0}), "sampling.top_p=0"),
        (_mapping(engine={"pipeline": "yes"}), "engine.pipeline='yes': expected true or false"),
        (_mapping(engine={"pipeline": 1}), "engine.pipeline=1: expected true or false"),
        (_mapping(model={"preset": "tiny", "path": "m"}), "exactly one of model.path"),
        (_mapping(requests=[{"max_tokens": 3}]), "requests[0]: expected exactly one of prompt"),
        (_mapping(requests=[{"prompt": "a", "messages": [{"role": "user", "content": "a"}]}]),
         "got prompt and messages"),
        (_mapping(requests=[{"messages": []}]), "requests[0].messages=[]"),
        (_mapping(requests=[{"messages": "hi"}]), "requests[0].messages='hi'"),
        (_mapping(requests=[{"messages": [{"role": "user", "content": "a"}, {"role": "bot", "content": "b"}]}]),
         "requests[0].messages[1].role='bot': expected one of system, user, assistant"),
        (_mapping(requests=[{"messages": [{"role": "user", "content": 3}]}]), "requests[0].messages[0].content=3"),
        (_mapping(requests=[{"messages": [{"role": "user"}]}]),
         "missing required key 'requests[0].messages[0].content'"),
        (_mapping(requests=[{"messages": [{"role": "user", "content": "a", "name": "x"}]}]),
         "unknown key 'requests[0].messages[0].name'"),
        (_mapping(requests=[{"messages": ["hi"]}]), "requests[0].messages[0]: expected a table"),
        (_mapping(requests=[{"prompt": "a", "stop": "x"}]), "requests[0].stop='x'"),
        (_mapping(requests=[{"prompt": "a", "stop": [""]}]), "requests[0].stop"),
        (_mapping(model={"path": "m", "fallback": "tiny"}), "model.fallback: only a preset falls back"),
        (_mapping(model={"preset": "tiny", "dequantize": "yes"}), 'model.dequantize=\'yes\': expected "auto", true'),
        (_mapping(model={"preset": "tiny", "dequantize": 1}), 'model.dequantize=1: expected "auto", true or false'),
        (_mapping(model={"preset": "tiny", "dequantize_max_mb": -1}), "model.dequantize_max_mb=-1: expected an"),
        (_mapping(model={"preset": "tiny", "dequantize_max_mb": 1.5}), "model.dequantize_max_mb=1.5"),
        (_mapping(model={"preset": "tiny", "dequantize_max_mb": "4G"}), "model.dequantize_max_mb='4G'"),
        (_mapping(requests=[{"prompt": "a", "n": 0}]), "requests[0].n=0"),
        (_mapping(requests=[]), "no [[requests]]"),
    ],
)
def test_a_bad_value_names_the_key(data, needle):
    with pytest.raises(ConfigError) as info:
        RunConfig.from_mapping(data, source="x.toml")
    assert needle in str(info.value) and "x.toml" in str(info.value)


def test_a_relative_model_path_is_taken_from_the_config_file(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('[model]\npath = "models/tiny"\n[[requests]]\nprompt = "hi"\n')
    assert load_config(path).model_dir() == (tmp_path / "models" / "tiny").resolve()


def test_layout_override_needs_backend_and_kind():
    cfg = load_config(None)
    assert cfg.with_layout("mlx:seq").layout.key == "mlx:seq"
    with pytest.raises(ConfigError, match="backend:kind"):
        cfg.with_layout("seq")


def test_the_cache_section_is_cache_config_s_chosen_fields_checked_by_its_rules():
    import attrs

    from kvlayout.config import SHAPE_FIELDS, CacheConfig, LayerConfig
    from kvlayout.runner.config import CacheSection

    chosen = [f.name for f in attrs.fields(CacheConfig) if f.name not in SHAPE_FIELDS]
    assert [f.name for f in attrs.fields(CacheSection)] == chosen
    # One rule, named as each reader writes the field.
    with pytest.raises(ConfigError, match=r"^cache\.kv_group_size=32 with kv_dtype='auto': a group size applies"):
        CacheSection(kv_group_size=32)
    with pytest.raises(
        ConfigError, match=r"^CacheConfig\.kv_group_size=32 with kv_dtype='float16': a group size applies"
    ):
        CacheConfig(capacity=8, n_layers=1, layers=[LayerConfig(1, 64)], kv_group_size=32)
    with pytest.raises(ConfigError, match=r"^cache\.kv_dtype='int8': expected one of auto, float16"):
        CacheSection(kv_dtype="int8")


def test_the_cache_section_gives_the_model_s_cache_config_with_pools_no_larger_than_its_capacity():
    from kvlayout.config import CacheConfig, LayerConfig
    from kvlayout.runner.config import CacheSection

    section = CacheSection(capacity=100, kv_dtype="auto", initial_capacity=512, max_write=4, max_seqs=3)
    assert section.cache_config(2, [LayerConfig(2, 64)], "float32") == CacheConfig(
        capacity=100,
        n_layers=2,
        layers=[LayerConfig(2, 64)],
        kv_dtype="float32",
        initial_capacity=100,
        max_write=4,
        max_seqs=3,
    )
    quantized = CacheSection(kv_dtype="q4", kv_group_size=32).cache_config(1, [LayerConfig(1, 96)], "q4")
    assert (quantized.kv_dtype, quantized.kv_group_size, quantized.capacity) == ("q4", 32, 4096)


def test_the_dequantize_budget_defaults_to_a_quarter_of_physical_memory_at_most_4096_mb(monkeypatch):
    from kvlayout.runner import config

    pages = {"SC_PAGE_SIZE": 4096, "SC_PHYS_PAGES": 8 * 2**30 // 4096}  # 8 GiB
    monkeypatch.setattr(config.os, "sysconf", lambda name: pages[name])
    assert config.ModelSection(preset="tiny").dequantize_max_mb == 2048
    pages["SC_PHYS_PAGES"] *= 4  # 32 GiB: a quarter is past the cap
    assert config.ModelSection(preset="tiny").dequantize_max_mb == 4096

    def unknown(name):
        raise ValueError(f"unrecognized configuration name {name}")

    monkeypatch.setattr(config.os, "sysconf", unknown)
    assert config.ModelSection(preset="tiny").dequantize_max_mb == 4096
    assert config.ModelSection(preset="tiny", dequantize_max_mb=0).dequantize_max_mb == 0  # any budget set stays


def test_print_config_writes_the_dequantize_keys_and_reads_them_back():
    from kvlayout.runner.config import default_dequantize_max_mb, dump_config, parse_config

    cfg = RunConfig.from_mapping(_mapping(model={"preset": "tiny", "dequantize": False, "dequantize_max_mb": 512}))
    printed = dump_config(cfg)
    assert "\ndequantize = false\ndequantize_max_mb = 512\n" in printed
    assert parse_config(printed, "printed") == cfg
    default = dump_config(load_config(None))
    assert f'\ndequantize = "auto"\ndequantize_max_mb = {default_dequantize_max_mb()}\n' in default
    assert parse_config(default, "printed") == load_config(None)
    for value in (True, "auto"):
        cfg = RunConfig.from_mapping(_mapping(model={"preset": "tiny", "dequantize": value}))
        assert parse_config(dump_config(cfg), "printed").model.dequantize == value
