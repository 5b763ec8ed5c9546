"""`kvlayout run` and `kvlayout init-model`: exit codes, one-line errors, the JSON schema."""

from __future__ import annotations

import json
import subprocess
import sys

import mlx.core as mx
import pytest

from kvlayout.cli import main


def test_run_with_no_arguments_runs_the_embedded_default_and_exits_0():
    proc = subprocess.run(
        [sys.executable, "-m", "kvlayout.cli", "run"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert "mlx:cell" in proc.stdout
    # The chosen storage dtype is stated: float32 on the CPU device.
    assert "kv_dtype float32" in proc.stdout or mx.default_device() != mx.cpu
    assert "Traceback" not in proc.stderr


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
