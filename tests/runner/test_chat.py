"""Chat requests, stop strings and end-of-sequence ids, through the runner and both layouts.

Oracles: transformers' `apply_chat_template` for the prompt ids, the
cache-free greedy forward (`oracle_greedy`) for what is generated, and the
whole decode of its tokens, cut by hand, for where a stop string ends it.
"""

from __future__ import annotations

import pytest

from kvlayout.errors import ConfigError
from kvlayout.models.loading import load_model
from kvlayout.runner import job
from tests.chat_dirs import ENDOFTEXT, IM_END, chat_model_dir
from tests.runner.conftest import make_config, oracle_greedy, token_ids

LAYOUTS = ["mlx:seq", "mlx:cell"]
MESSAGES = [
    {"role": "system", "content": "You answer in one line."},
    {"role": "user", "content": "What is the capital of France? Café? 日本語?"},
]


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    return chat_model_dir(tmp_path_factory.mktemp("chat"))


@pytest.fixture(scope="module")
def chat_loaded(chat_dir):
    return (*load_model(chat_dir), str(chat_dir))


def chat_request(**kw):
    return {"messages": MESSAGES, "max_tokens": 12, "n": 2, **kw}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_chat_request_runs_the_ids_apply_chat_template_gives(chat_dir, chat_loaded, layout):
    transformers = pytest.importorskip("transformers")
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(str(chat_dir))
    want_ids = hf.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    prepared = job.prepare(make_config(chat_dir, layout, requests=[chat_request()]), loaded=chat_loaded)
    assert prepared.prompts == [want_ids]
    result = prepared.generate()
    assert result.prompts[0] == hf.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    model, _, tok, _ = chat_loaded
    want, _ = oracle_greedy(model, want_ids, 12, frozenset(tok.eos_ids))
    assert token_ids(result) == [[want, want]]
    assert result.to_json()["requests"][0]["messages"] == MESSAGES


def test_a_chat_on_a_model_without_a_template_is_refused_naming_the_request(tmp_path):
    d = chat_model_dir(tmp_path / "m", template=None)
    cfg = make_config(d, requests=[{"prompt": "fine"}, chat_request()])
    with pytest.raises(ConfigError, match=r"requests\[1\]\.messages: the model has no chat template"):
        job.prepare(cfg)


def test_a_template_refusing_the_messages_names_the_request(tmp_path):
    d = chat_model_dir(tmp_path / "m", template="{{ raise_exception('only users here') }}")
    with pytest.raises(ConfigError, match=r"requests\[0\]\.messages: .*refused the messages: only users here"):
        job.prepare(make_config(d, requests=[chat_request()]))


def stop_inside(tok, ids: list[int]) -> tuple[str, int]:
    """A stop string straddling two tokens of `ids` that first occurs there: (it, tokens up to its end)."""
    for k in range(2, len(ids)):
        before, upto = tok.decode(ids[: k - 1]), tok.decode(ids[:k])
        if not before or len(upto) <= len(before) or not upto.startswith(before):
            continue
        stop = before[-1] + upto[len(before)]
        if upto.find(stop) == len(before) - 1 and stop.isprintable() and "\ufffd" not in stop:
            return stop, k
    raise AssertionError("no stop string straddles two tokens of this output")


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("which", ["bytes", "bpe"])
def test_a_stop_string_cuts_the_text_before_it_and_nothing_after_it_is_generated(
    tiny_dir, tiny_loaded, chat_dir, chat_loaded, layout, which
):
    model_dir, loaded = (tiny_dir, tiny_loaded) if which == "bytes" else (chat_dir, chat_loaded)
    model, _, tok, _ = loaded
    request = {"prompt": "You are a terse assistant.\nQ: what is a KV cache?\nA:", "max_tokens": 24, "n": 2}
    free, _ = oracle_greedy(model, tok.encode(request["prompt"]), 24, frozenset(tok.eos_ids))
    stop, k = stop_inside(tok, free)
    full = tok.decode(free[:k])
    cfg = make_config(model_dir, layout, requests=[{**request, "stop": ["never there", stop]}])
    result = job.run(cfg, loaded=loaded)
    for s in result.outputs[0]:
        assert s.finish_reason == "stop"
        assert s.token_ids == free[:k]  # the token completing the stop string is the last one
        assert s.text == full[: full.find(stop)]
    assert result.stats.generated_tokens == 2 * k


@pytest.mark.parametrize("layout", LAYOUTS)
def test_generation_stops_on_an_eos_id_only_generation_config_names(tmp_path, layout):
    plain = chat_model_dir(tmp_path / "plain")
    loaded = (*load_model(plain), str(plain))
    model, _, tok, _ = loaded
    prompt = "Q: what is a KV cache?\nA:"
    free, _ = oracle_greedy(model, tok.encode(prompt), 16, frozenset(tok.eos_ids))
    j = next(i for i in range(2, len(free)) if free[i] not in free[:i])  # its first occurrence
    # The same weights, now with generation_config.json naming free[j] as an end of turn.
    d = chat_model_dir(tmp_path / "gen", generation_eos=[IM_END, free[j]])
    result = job.run(make_config(d, layout, requests=[{"prompt": prompt, "max_tokens": 16}]))
    (s,) = result.outputs[0]
    assert (s.token_ids, s.finish_reason) == (free[:j], "stop")
    assert ENDOFTEXT in job.load_model_for(make_config(d))[2].eos_ids  # config.json's stays


def test_stop_strings_are_part_of_what_a_resumed_run_must_match(tiny_dir, tiny_loaded, tmp_path):
    from kvlayout.errors import StateError

    cfg = make_config(tiny_dir, requests=[{"prompt": "abc", "max_tokens": 8, "stop": ["x"]}])
    job.prepare(cfg, loaded=tiny_loaded).generate(stop=lambda: True, save_state=tmp_path)
    other = make_config(tiny_dir, requests=[{"prompt": "abc", "max_tokens": 8, "stop": ["y"]}])
    with pytest.raises(StateError, match="differs in: requests"):
        job.prepare(other, loaded=tiny_loaded, resume=tmp_path)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_text_events_of_each_sample_join_to_its_final_text(chat_dir, chat_loaded, layout):
    heard: dict = {}
    ends: dict = {}

    def on_text(event):
        key = (event.request, event.sample)
        assert key not in ends  # nothing after a sample's last event
        heard[key] = heard.get(key, "") + event.text
        if event.finish_reason is not None:
            ends[key] = event.finish_reason

    requests = [chat_request(max_tokens=20, stop=["ü"]), {"prompt": "日本語 😀", "max_tokens": 9, "n": 2}]
    cfg = make_config(chat_dir, layout, requests=requests, sampling={"temperature": 0.9})
    result = job.prepare(cfg, loaded=chat_loaded).generate(on_text=on_text)
    for i, samples in enumerate(result.outputs):
        for j, s in enumerate(samples):
            assert heard[i, j] == s.text and ends[i, j] == s.finish_reason
