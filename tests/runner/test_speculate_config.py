"""[engine] speculate and speculate_tokens: their defaults, their refusals (a config file's and
`kvlayout run`'s flags', each one line naming the key), and how they reach the engine and --json."""

from __future__ import annotations

import json

import pytest

from kvlayout.cli import continue_command, main, make_parser
from kvlayout.engines.records import Stats
from kvlayout.runner import job
from kvlayout.runner.config import EngineSection, RunConfig, load_config, parse_config
from tests.helpers import refused_in_one_line

REQUEST = '[[requests]]\nprompt = "a"\n'


def _write(tmp_path, text: str) -> str:
    path = tmp_path / "run.toml"
    path.write_text(text)
    return str(path)


def test_speculation_is_off_by_default_with_four_tokens():
    assert (EngineSection().speculate, EngineSection().speculate_tokens) == ("off", 4)
    # The embedded default run does not speculate (its [engine] mentions it in a comment only).
    assert load_config(None).engine == EngineSection(prefill_chunk=256, pipeline=True)


@pytest.mark.parametrize(
    "value, shown", [('"fast"', "'fast'"), ("1", "1"), ("true", "True"), ('""', "''"), ('"NGRAM"', "'NGRAM'")]
)
def test_a_bad_speculate_in_a_config_is_one_line_naming_the_key(tmp_path, capsys, value, shown):
    config = _write(tmp_path, f"[engine]\nspeculate = {value}\n{REQUEST}")
    line = refused_in_one_line(capsys, "run", config)
    assert f'engine.speculate={shown}: expected "off" or "ngram"' in line


@pytest.mark.parametrize("value, shown", [("0", "0"), ("17", "17"), ("2.5", "2.5"), ('"4"', "'4'"), ("true", "True")])
def test_a_bad_speculate_tokens_in_a_config_is_one_line_naming_the_key(tmp_path, capsys, value, shown):
    config = _write(tmp_path, f"[engine]\nspeculate_tokens = {value}\n{REQUEST}")
    line = refused_in_one_line(capsys, "run", config)
    assert f"engine.speculate_tokens={shown}: expected an integer in [1, 16]" in line


@pytest.mark.parametrize("tokens", ["1", "16"])
def test_the_ends_of_speculate_tokens_are_taken(tokens):
    data = {"engine": {"speculate": "ngram", "speculate_tokens": int(tokens)}, "requests": [{"prompt": "a"}]}
    assert RunConfig.from_mapping(data).engine.speculate_tokens == int(tokens)


@pytest.mark.parametrize("value", ["0", "17", "-3"])
def test_a_speculate_tokens_flag_out_of_range_is_one_line_naming_the_key(tmp_path, capsys, value):
    line = refused_in_one_line(capsys, "run", _write(tmp_path, REQUEST), "--speculate-tokens", value)
    assert f"engine.speculate_tokens={value}: expected an integer in [1, 16]" in line


@pytest.mark.parametrize(
    "argv, needle",
    [
        (["--speculate", "fast"], "argument --speculate: invalid choice: 'fast'"),
        (["--speculate-tokens", "2.5"], "argument --speculate-tokens: invalid int value: '2.5'"),
        (["--speculate-tokens", "four"], "argument --speculate-tokens: invalid int value: 'four'"),
    ],
)
def test_a_flag_that_is_not_a_choice_or_an_integer_is_one_line(tmp_path, capsys, argv, needle):
    # argparse's own refusal: exit 2 (SystemExit, before main's body runs), one line, no usage text.
    with pytest.raises(SystemExit) as info:
        main(["run", _write(tmp_path, REQUEST), *argv])
    assert info.value.code == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvlayout: error: run: ") and needle in lines[0], err


def _printed_engine(capsys, *argv) -> EngineSection:
    assert main(["run", *argv, "--print-config"]) == 0
    text = capsys.readouterr().out
    return parse_config(text, "printed").engine


def test_the_flags_override_only_the_keys_they_give(tmp_path, capsys):
    config = _write(tmp_path, f"[engine]\nspeculate_tokens = 8\nprefill_chunk = 32\n{REQUEST}")
    assert _printed_engine(capsys, config) == EngineSection(prefill_chunk=32, speculate_tokens=8)
    assert _printed_engine(capsys, config, "--speculate", "ngram") == EngineSection(
        prefill_chunk=32, speculate="ngram", speculate_tokens=8
    )
    assert _printed_engine(capsys, config, "--speculate-tokens", "2") == EngineSection(
        prefill_chunk=32, speculate_tokens=2
    )


def test_the_flags_apply_to_one_prompt_too(capsys):
    engine = _printed_engine(capsys, "--prompt", "hi", "--speculate", "ngram", "--speculate-tokens", "16")
    assert (engine.speculate, engine.speculate_tokens) == ("ngram", 16)


def test_a_continued_run_gets_the_same_flags():
    args = make_parser().parse_args(["run", "x.toml", "--speculate", "ngram", "--speculate-tokens", "3"])
    command = continue_command(args, None, "st")
    assert "--speculate ngram --speculate-tokens 3" in command


def test_the_job_hands_the_engine_section_to_the_engine(tiny_loaded, monkeypatch):
    cfg = RunConfig.from_mapping({
        "model": {"path": tiny_loaded[3]},
        "cache": {"capacity": 64},
        "engine": {"speculate": "ngram", "speculate_tokens": 7},
        "requests": [{"prompt": "a", "max_tokens": 2}],
    })
    made = {}
    monkeypatch.setattr(job, "CellEngine", lambda model, cache, bc, options, prefixes: made.setdefault("o", options))
    monkeypatch.setattr(job, "SeqEngine", lambda model, cache, control, options: made.setdefault("o", options))
    job.prepare(cfg, loaded=tiny_loaded).make_engine(Stats(), lambda n: None)
    assert (made["o"].speculate, made["o"].speculate_tokens) == ("ngram", 7)


def test_run_json_stats_count_drafted_and_accepted_tokens(tiny_dir, capsys):
    assert main(["run", "--model", str(tiny_dir), "--prompt", "abc", "--max-tokens", "3", "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)["stats"]
    assert stats["drafted_tokens"] == stats["accepted_tokens"] == 0  # speculation is off unless asked for


def test_the_flag_offers_what_the_engines_take():
    from kvlayout.engines.options import SPECULATE

    for value in SPECULATE:
        assert make_parser().parse_args(["run", "--speculate", value]).speculate == value
