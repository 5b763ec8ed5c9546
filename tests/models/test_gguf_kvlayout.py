"""kvlayout running converted GGUF directories, against mlx-lm on the same directory.

The converted directories are quantized (Q4_1 as 4-bit affine, Q8_0 as
8-bit), so these tests run kvlayout's quantized loading end to end.
"""

from __future__ import annotations

import json

import mlx.core as mx
import mlx_lm.utils as mlx_lm_utils
import numpy as np
import pytest

from kvlayout.cli import main
from kvlayout.models import smollm2
from kvlayout.models.gguf import convert_gguf
from kvlayout.models.loading import load_model
from tests.models import gguf_builders as gb
from tests.models.quantized import mlx_lm_greedy
from tests.models.test_smollm2 import CHAT_IDS
from tests.runner.conftest import NoCache

MAX_TOKENS = 8


def test_a_q4_0_q8_0_conversion_loads_in_kvlayout_with_mlx_lms_logits(tmp_path):
    cfg, weights = gb.tiny_llama(tie_word_embeddings=True)
    tensors = gb.gguf_tensors(cfg, weights)
    types = {n: gb.GGML_Q4_0 for n, w in tensors.items() if w.ndim == 2} | {"token_embd.weight": gb.GGML_Q8_0}
    out = convert_gguf(gb.write_gguf(tmp_path / "m.gguf", tensors, gb.metadata(cfg), types), tmp_path / "c")
    ours, args, _ = load_model(out)
    theirs, _ = mlx_lm_utils.load_model(out)
    ids = [int(t) for t in np.random.default_rng(2).integers(0, cfg["vocab_size"], 20)]
    got = ours(ids, range(len(ids)), NoCache(args.windows))  # [T, V]
    want = theirs(mx.array(ids)[None])[0]  # [T, V]
    assert mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max().item() < 1e-2


@pytest.fixture(scope="module")
def smollm2_greedy():
    """(the SmolLM2 directory, mlx-lm's greedy tokens on it): the oracle, run once for both layouts."""
    model_dir = smollm2.smollm2_dir(progress=lambda line: None)
    return model_dir, mlx_lm_greedy(model_dir, CHAT_IDS, MAX_TOKENS)


@pytest.mark.parametrize("layout", ["mlx:seq", "mlx:cell"])
def test_greedy_tokens_from_kvlayout_equal_mlx_lms_on_smollm2(layout, tmp_path, capsys, smollm2_greedy):
    model_dir, want = smollm2_greedy
    cfg = tmp_path / "run.toml"
    cfg.write_text(
        # Kept packed: mlx-lm's quantized kernels are the oracle here (test_dequantize has the unpacked path).
        f'[model]\npath = "{model_dir}"\ndequantize = false\n[cache]\ncapacity = 256\n[sampling]\ntemperature = 0.0\n'
        f"[[requests]]\nprompt_ids = {CHAT_IDS}\nmax_tokens = {MAX_TOKENS}\n"
    )
    assert main(["run", str(cfg), "--json", "--layout", layout]) == 0
    sample = json.loads(capsys.readouterr().out)["requests"][0]["samples"][0]
    assert sample["token_ids"] == want
    assert sample["text"].startswith("The capital of France is Paris")
