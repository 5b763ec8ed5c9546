"""[model] dequantize in a run: when a quantized checkpoint is unpacked at load, what the run says about
it, and that quantized K/V cells stay quantized whatever the weights are.

The oracles are mlx-lm's: the directory `mlx_lm.convert --dequantize` writes (its tensors' bytes are the
float32 size the budget is held against) and its QuantizedKVCache's greedy tokens on that directory.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import mlx.core as mx
import pytest

from kvlayout.cli import main
from kvlayout.runner import blas, job
from tests.models.quantized import convert_tiny, mlx_lm_dequantized, packings
from tests.runner.conftest import make_config
from tests.runner.test_quantized_kv import STEPS
from tests.runner.test_quantized_kv import mlx_lm_greedy as mlx_lm_quantized_kv_greedy

PROMPT = [int(t) for t in range(40, 70)]
REQUESTS = [{"prompt_ids": PROMPT, "max_tokens": 4}]


@pytest.fixture(scope="module")
def q4_dir(tmp_path_factory) -> Path:
    """The tiny preset with head_dim 64 (which q8 cells' groups divide), 4-bit by `mlx_lm.convert -q`."""
    return convert_tiny(tmp_path_factory.mktemp("dequantize_run") / "q4", 4, 32, head_dim=64)


@pytest.fixture(scope="module")
def need_mb(q4_dir, tmp_path_factory) -> int:
    """MB (2**20 bytes, rounded up) of the float32 tensors mlx-lm's convert --dequantize writes for q4_dir."""
    written = mx.load(str(mlx_lm_dequantized(q4_dir, tmp_path_factory.mktemp("need") / "f32") / "model.safetensors"))
    return math.ceil(sum(t.nbytes for t in written.values()) / 2**20)


@pytest.fixture
def on_the_cpu(monkeypatch):
    """The CPU as the default device with a fast BLAS, where "auto" dequantizes (the Linux wheel's
    only device; the BLAS a `kvlayout` command preloads, kvlayout.runner.blas, not this process's)."""
    monkeypatch.setattr(blas, "fast", lambda: True)
    before = mx.default_device()
    mx.set_default_device(mx.cpu)
    yield
    mx.set_default_device(before)


def prepared(model_dir: Path, layout: str = "mlx:cell", **sections) -> job.Job:
    return job.prepare(make_config(model_dir, layout, requests=REQUESTS, **sections))


def is_packed(j: job.Job) -> bool:
    return any(packings(j.model).values())


def test_auto_on_the_cpu_dequantizes_and_the_report_names_it(q4_dir, on_the_cpu):
    j = prepared(q4_dir)
    assert not is_packed(j) and j.model.dtype == mx.float32
    assert j.model_name == f"{q4_dir.resolve()} (4-bit dequantized to float32)"
    assert not [n for n in j.notices if "quantized" in n]
    result = j.generate()
    assert result.to_json()["model"] == j.model_name and result.stats.model == j.model_name


def test_auto_over_the_budget_keeps_it_quantized_and_the_run_says_so_in_one_line(
    q4_dir, need_mb, on_the_cpu, tmp_path, capsys
):
    assert not is_packed(prepared(q4_dir, model={"dequantize_max_mb": need_mb}))  # exactly the budget fits
    j = prepared(q4_dir, model={"dequantize_max_mb": need_mb - 1})
    assert is_packed(j) and j.model_name == str(q4_dir.resolve())
    said = (f"{q4_dir.resolve()} stays 4-bit quantized: its float32 weights would take {need_mb} MB, "
            f"over model.dequantize_max_mb={need_mb - 1}; raise it")
    assert [n for n in j.notices if "dequantize_max_mb" in n][0].startswith(said)
    # The CLI says it once on stderr, one line, and runs.
    cfg = tmp_path / "run.toml"
    cfg.write_text(f'[model]\npath = "{q4_dir}"\ndequantize_max_mb = {need_mb - 1}\n'
                   f"[[requests]]\nprompt_ids = {PROMPT}\nmax_tokens = 2\n")
    assert main(["run", str(cfg), "--json"]) == 0
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if "dequantize_max_mb" in line]
    assert len(lines) == 1 and lines[0].startswith(f"kvlayout: {said}")
    assert json.loads(out)["model"] == str(q4_dir.resolve())


def test_false_keeps_it_quantized_on_the_cpu_and_says_nothing(q4_dir, on_the_cpu):
    j = prepared(q4_dir, model={"dequantize": False})
    assert is_packed(j) and j.model_name == str(q4_dir.resolve())
    assert not [n for n in j.notices if "quantized" in n]


def test_auto_leaves_a_half_precision_run_quantized(q4_dir, on_the_cpu):
    j = prepared(q4_dir, model={"dtype": "float16"})
    assert is_packed(j) and j.model.dtype == mx.float16 and j.model_name == str(q4_dir.resolve())


def test_auto_leaves_it_quantized_on_the_reference_blas(q4_dir, on_the_cpu, monkeypatch):
    # The bundled reference BLAS multiplies float32 slower than MLX's packed kernels decode.
    monkeypatch.setattr(blas, "fast", lambda: False)
    j = prepared(q4_dir)
    assert is_packed(j) and not j.notices


def test_auto_leaves_it_quantized_off_the_cpu(q4_dir, monkeypatch):
    # A GPU's quantized kernels are fast: "auto" asks the default device, here made to answer gpu.
    monkeypatch.setattr(job.mx, "default_device", lambda: mx.gpu)
    j = prepared(q4_dir, cache={"kv_dtype": "float32"})
    assert is_packed(j)


def test_true_dequantizes_into_the_model_dtype_whatever_the_budget(q4_dir):
    j = prepared(q4_dir, model={"dequantize": True, "dtype": "float16", "dequantize_max_mb": 0})
    assert not is_packed(j) and j.model.dtype == mx.float16
    assert j.model_name == f"{q4_dir.resolve()} (4-bit dequantized to float16)"


def test_a_float_checkpoint_is_left_as_it_is(tiny_dir, on_the_cpu):
    j = prepared(tiny_dir, model={"dequantize": True})
    assert j.model_name == str(Path(tiny_dir).resolve())


def test_a_dequantized_model_still_holds_q8_cells(q4_dir, on_the_cpu):
    result = prepared(q4_dir, cache={"kv_dtype": "q8"}).generate()
    assert result.stats.model.endswith("(4-bit dequantized to float32)")
    assert result.stats.kv_dtype == "q8"
    # 2 layers x K and V x 2 heads x (64 elements at 8 bits = 64 B, + one float16 scale and bias = 4 B).
    assert result.kv_bytes.per_cell == 2 * 2 * 2 * 68


@pytest.mark.parametrize("layout", ["mlx:seq", "mlx:cell"])
def test_q8_cells_of_a_dequantized_model_give_mlx_lm_quantized_kv_cache_tokens(q4_dir, tmp_path, layout):
    # In float16, where kvlayout's and mlx-lm's quantized K/V store the same triples (test_quantized_kv).
    oracle = mlx_lm_dequantized(q4_dir, tmp_path / "f16", "float16")
    want = mlx_lm_quantized_kv_greedy(oracle, PROMPT, 8, 64)
    cfg = make_config(q4_dir, layout, requests=[{"prompt_ids": PROMPT, "max_tokens": STEPS}],
                      cache={"kv_dtype": "q8", "kv_group_size": 64}, model={"dequantize": True, "dtype": "float16"})
    result = job.run(cfg)
    got = result.outputs[0][0].token_ids
    assert result.stats.kv_dtype == "q8" and "dequantized to float16" in result.stats.model
    assert got == want[: len(got)] and (len(got) == STEPS or want[len(got)] == 257)  # cut only at the EOS
    assert len(got) >= 3
