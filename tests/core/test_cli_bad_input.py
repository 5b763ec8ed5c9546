"""Bad input to the `kvlayout` command: one line, exit 2, never a traceback.

Each row runs the real command in a subprocess (this tree's code) with one
wrong thing: an argument of the wrong type, a missing value, an empty
string, a path that is a directory, missing, not UTF-8 or binary, a flag that
does not go with another, standard input closed or not text, an environment
variable with an odd value. The command must exit 2 with exactly one line on
stderr, `kvlayout: error: ...` naming what to fix, and nothing on stdout.

The rows come from a sweep of every command with every kind of wrong
argument. They run concurrently, once per module (`outcomes`), so the table
costs a few seconds.
"""

from __future__ import annotations

import concurrent.futures
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.chat_dirs import chat_model_dir
from tests.helpers import cli_env, kvlayout

# Files the rows name as {d}/NAME (written once into a temporary directory); {tiny} is the tiny model.
FILES: dict[str, bytes] = {
    "good.toml": b'[model]\npath = "{tiny}"\n[[requests]]\nprompt = "hi"\nmax_tokens = 2\n',
    "latin1.toml": '[[requests]]\nprompt = "h\xe9llo"\n'.encode("latin-1"),
    "utf16.toml": '[[requests]]\nprompt = "hi"\n'.encode("utf-16"),
    "binary.toml": bytes(range(256)),
    "invalid.toml": b"[cache\n",
}

# Model directories the rows name as {d}/NAME: (the tiny preset, or "chat": the tiny model with a
# tokenizer.json and a chat template), with files replaced (bytes), made directories ("DIR") or added.
MODELS: dict[str, tuple[str, dict]] = {
    "config-latin1": ("tiny", {"config.json": '{"model_type": "ll\xe9ma"}'.encode("latin-1")}),
    "config-list": ("tiny", {"config.json": b"[1, 2]"}),
    "config-dir": ("tiny", {"config.json": "DIR"}),
    "generation-latin1": ("tiny", {"generation_config.json": b'{"eos_token_id": "\xe9"}'}),
    "tokenizer-garbage": ("chat", {"tokenizer.json": b'{"version": 1}'}),
    "tokenizer-latin1": ("chat", {"tokenizer.json": b'{"\xe9": 1}'}),
    "tokenizer-config-latin1": ("chat", {"tokenizer_config.json": b'{"chat_template": "\xe9"}'}),
    "template-latin1": ("chat", {"chat_template.jinja": b"{{ messages }}\xe9"}),
}
MODEL = ["run", "--prompt", "hi", "--raw", "--max-tokens", "2", "--model"]

# id: (argv, what the one line must hold, options for tests.helpers.kvlayout)
ROWS: dict[str, tuple[list, str, dict]] = {
    # argparse's own refusals, one line like every other
    "no command": ([], "the following arguments are required: command", {}),
    "an unknown command": (["nope"], "invalid choice: 'nope'", {}),
    "an unknown flag": (["run", "--nope"], "unrecognized arguments: --nope", {}),
    "two configs": (["run", "{d}/good.toml", "{d}/good.toml"], "unrecognized arguments: ", {}),
    "--max-tokens not an integer": (["run", "--prompt", "x", "--max-tokens", "1.5"],
                                    "run: argument --max-tokens: invalid int value: '1.5'", {}),
    "--temperature not a number": (["run", "--prompt", "x", "--temperature", "warm"],
                                   "run: argument --temperature: invalid float value: 'warm'", {}),
    "--layout without its value": (["run", "--layout"], "run: argument --layout: expected one argument", {}),
    "--json given a value": (["plugins", "--json=yes"], "argument --json: ignored explicit argument 'yes'", {}),
    "--json on init-model": (["init-model", "{d}/m", "--json"], "unrecognized arguments: --json", {}),
    "init-model without a directory": (["init-model"], "init-model: the following arguments are required: dir", {}),
    "init-model --seed not an integer": (["init-model", "{d}/m", "--seed", "x"], "invalid int value: 'x'", {}),
    "init-model --preset with --from-gguf": (["init-model", "{d}/m", "--preset", "tiny", "--from-gguf", "{d}/x.gguf"],
                                             "argument --from-gguf: not allowed with argument --preset", {}),
    "bench --quick with --full": (["bench", "--quick", "--full"],
                                  "argument --full: not allowed with argument --quick", {}),
    # the config file: each way a path can fail to be a TOML file
    "config missing": (["run", "{d}/absent.toml"], "config file '{d}/absent.toml' does not exist", {}),
    "config a directory": (["run", "{d}"], "config file '{d}' is a directory", {}),
    "config through a file": (["run", "{d}/good.toml/x.toml"], "cannot be read (Not a directory)", {}),
    "config not UTF-8": (["run", "{d}/latin1.toml"], "latin1.toml: not UTF-8 text (byte 0xe9 at offset 24)", {}),
    "config UTF-16": (["run", "{d}/utf16.toml"], "utf16.toml: not UTF-8 text (byte 0xff at offset 0)", {}),
    "config binary": (["run", "{d}/binary.toml"], "binary.toml: not UTF-8 text (byte 0x80 at offset 128)", {}),
    "config not TOML": (["run", "{d}/invalid.toml"], "invalid.toml: invalid TOML (", {}),
    "config /dev/null": (["run", "/dev/null"], "/dev/null: no [[requests]]", {}),
    # an empty value, which would count as not given (or as the working directory)
    "config empty": (["run", ""], "run: argument config: expected a value, got an empty string", {}),
    "--layout empty": (["run", "{d}/good.toml", "--layout", ""], "argument --layout: expected a value", {}),
    "--model empty": (["run", "{d}/good.toml", "--model", ""], "argument --model: expected a value", {}),
    "--save-state empty": (["run", "{d}/good.toml", "--save-state", ""], "argument --save-state: expected a value", {}),
    "--resume empty": (["run", "{d}/good.toml", "--resume", ""], "argument --resume: expected a value", {}),
    "init-model into ''": (["init-model", ""], "init-model: argument dir: expected a value", {}),
    "init-model --from-gguf empty": (["init-model", "{d}/m", "--from-gguf", ""],
                                     "argument --from-gguf: expected a value", {}),
    "bench --out empty": (["bench", "--out", ""], "bench: argument --out: expected a value", {}),
    "bench --rows empty": (["bench", "--rows", ""], "bench: argument --rows: expected a value", {}),
    "bench --rows only commas": (["bench", "--rows", ", ,"],
                                 "--rows ', ,': expected comma-separated rows, some of write", {}),
    "bench --model empty": (["bench", "--model", ""], "bench: argument --model: expected a value", {}),
    # a model directory's files, each named when it cannot be read
    "--model a file": (MODEL + ["{d}/good.toml"], "model directory '{d}/good.toml' is not a directory", {}),
    "config.json not UTF-8": (MODEL + ["{d}/config-latin1"],
                              "config.json: not UTF-8 text (byte 0xe9 at offset 18)", {}),
    "config.json not an object": (MODEL + ["{d}/config-list"],
                                  "config.json: expected a JSON object {...}, got a JSON array", {}),
    "config.json a directory": (MODEL + ["{d}/config-dir"], "config.json: cannot be read (Is a directory)", {}),
    "generation_config.json not UTF-8": (MODEL + ["{d}/generation-latin1"],
                                         "generation_config.json: not UTF-8 text (byte 0xe9", {}),
    "tokenizer.json not a tokenizer": (MODEL + ["{d}/tokenizer-garbage"],
                                       "tokenizer.json: not a tokenizer the tokenizers library reads (", {}),
    "tokenizer.json not UTF-8": (MODEL + ["{d}/tokenizer-latin1"], "tokenizer.json: not UTF-8 text (byte 0xe9", {}),
    "tokenizer_config.json not UTF-8": (MODEL + ["{d}/tokenizer-config-latin1"],
                                        "tokenizer_config.json: not UTF-8 text (byte 0xe9", {}),
    "chat_template.jinja not UTF-8": (MODEL + ["{d}/template-latin1"],
                                      "chat_template.jinja: not UTF-8 text (byte 0xe9 at offset 14)", {}),
    # --prompt's text: from the command line or standard input, closed, empty or not UTF-8
    "--prompt empty": (["run", "--prompt", ""], "--prompt: expected some text", {}),
    "--prompt - with stdin closed": (["run", "--model", "{tiny}", "--prompt", "-"],
                                     "--prompt -: standard input is closed", {"redirect": "<&-"}),
    "--prompt - with nothing on stdin": (["run", "--model", "{tiny}", "--prompt", "-"],
                                         "--prompt -: nothing came on standard input", {"stdin": b"\n"}),
    "--prompt - not UTF-8": (["run", "--model", "{tiny}", "--prompt", "-"],
                             "--prompt -: standard input is not UTF-8 text (byte 0xe9)", {"stdin": b"h\xe9llo\n"}),
    "--prompt - not UTF-8, strict locale": (["run", "--model", "{tiny}", "--prompt", "-"],
                                            "--prompt -: standard input is not utf-8 text (byte 0xe9)",
                                            {"stdin": b"h\xe9llo\n", "env": {"PYTHONIOENCODING": "utf-8:strict"}}),
    "--prompt not UTF-8": (["run", "--model", "{tiny}", "--prompt", b"h\xe9llo"],
                           "--prompt is not UTF-8 text (byte 0xe9)", {}),
    # --print-config prints and runs nothing
    "--print-config with --json": (["run", "--print-config", "--json"],
                                   "--print-config prints the config and runs nothing; drop --json", {}),
    "--print-config with --resume": (["run", "--print-config", "--resume", "{d}"], "runs nothing; drop --resume", {}),
    "--print-config of a missing file": (["run", "{d}/absent.toml", "--print-config"], "does not exist", {}),
    # the environment
    "KVLAYOUT_STRICT neither yes nor no": (["plugins"], "KVLAYOUT_STRICT='maybe': expected one of 1, true, yes, on",
                                           {"env": {"KVLAYOUT_STRICT": "maybe"}}),
    "KVLAYOUT_CACHE a file, init-model --preset smollm2": (
        ["init-model", "{d}/smollm2", "--preset", "smollm2"],
        "cannot fetch SmolLM2 into the kvlayout cache {d}/good.toml: ", {"env": {"KVLAYOUT_CACHE": "{d}/good.toml"}}),
    # bench --out is made before anything is measured
    "bench --out a file": (["bench", "--quick", "--rows", "fp16", "--out", "{d}/good.toml"],
                           "--out {d}/good.toml: cannot create the directory (File exists)", {}),
    "bench --out through a file": (["bench", "--quick", "--rows", "fp16", "--out", "{d}/good.toml/out"],
                                   "cannot create the directory (Not a directory)", {}),
}


def _fill(arg, d: Path, tiny: Path):
    return arg if isinstance(arg, bytes) else arg.replace("{d}", str(d)).replace("{tiny}", str(tiny))


@pytest.fixture(scope="module")
def outcomes(request, tiny_dir, tmp_path_factory) -> dict[str, object]:
    """Every selected row's finished command, run four at a time."""
    d = tmp_path_factory.mktemp("bad-input")
    for name, data in FILES.items():
        (d / name).write_bytes(data.replace(b"{tiny}", str(tiny_dir).encode()))
    bases = {"tiny": tiny_dir, "chat": chat_model_dir(d / "chat")}
    for name, (base, files) in MODELS.items():
        shutil.copytree(bases[base], d / name)
        for file, data in files.items():
            if data == "DIR":
                (d / name / file).unlink()
                (d / name / file).mkdir()
            else:
                (d / name / file).write_bytes(data)
    wanted = [item.callspec.params["row"] for item in request.session.items
              if item.module is request.module and "row" in getattr(getattr(item, "callspec", None), "params", {})]

    def run(row: str):
        argv, _, options = ROWS[row]
        options = dict(options)
        if "env" in options:
            options["env"] = cli_env(**{k: _fill(v, d, tiny_dir) for k, v in options["env"].items()})
        try:
            # In the temporary directory: a row that wrongly writes into "." must not write into the tree.
            return kvlayout(*(_fill(a, d, tiny_dir) for a in argv), cwd=d, timeout=60, **options)
        except subprocess.TimeoutExpired as exc:  # that row fails, not the table
            return subprocess.CompletedProcess(exc.cmd, None, "", f"timed out after {exc.timeout} s")

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        return {"{d}": d, **dict(zip(wanted, pool.map(run, wanted)))}


@pytest.mark.parametrize("row", list(ROWS))
def test_a_wrong_argument_is_one_line_and_exit_2(outcomes, row):
    done, needle = outcomes[row], ROWS[row][1].replace("{d}", str(outcomes["{d}"]))
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode == 2, done.stderr
    [line] = done.stderr.splitlines()
    assert line.startswith("kvlayout: error: ") and needle in line, line
    assert done.stdout == ""
