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
        (_mapping(requests=[{"messages": [{"role": "user"}]}]), "missing required key 'requests[0].messages[0].content'"),
        (_mapping(requests=[{"messages": [{"role": "user", "content": "a", "name": "x"}]}]),
         "unknown key 'requests[0].messages[0].name'"),
        (_mapping(requests=[{"messages": ["hi"]}]), "requests[0].messages[0]: expected a table"),
        (_mapping(requests=[{"prompt": "a", "stop": "x"}]), "requests[0].stop='x'"),
        (_mapping(requests=[{"prompt": "a", "stop": [""]}]), "requests[0].stop"),
        (_mapping(model={"path": "m", "fallback": "tiny"}), "model.fallback: only a preset falls back"),
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
