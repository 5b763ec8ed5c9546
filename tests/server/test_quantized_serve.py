"""`kvlayout serve` on quantized K/V: concurrent streams get what `kvlayout run` gives at the same
bits (itself checked against mlx-lm in tests/runner/test_quantized_kv.py), and /stats and
/metrics count the K/V bytes the used cells hold (hand-computed per cell)."""

from __future__ import annotations

import concurrent.futures
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvlayout.models.loading import load_model
from kvlayout.models.presets import write_preset
from kvlayout.runner import job
from tests.runner.conftest import make_config
from tests.server.conftest import serving

PROMPTS = ["a shared system line, then one question", "a shared system line, then another", "short"]


@pytest.fixture(scope="module")
def d64(tmp_path_factory):
    model_dir = write_preset(tmp_path_factory.mktemp("serve_d64"), "tiny", seed=5, head_dim=64)
    model, args, tok = load_model(model_dir)
    return model_dir, (model, args, tok, str(model_dir))


def test_streams_on_q4_cells_equal_kvlayout_run_at_the_same_bits(d64):
    model_dir, loaded = d64
    requests = [{"prompt": p, "max_tokens": 6} for p in PROMPTS]
    want = job.run(make_config(Path(model_dir), "mlx:cell", requests=requests, cache={"kv_dtype": "q4"}), loaded=loaded)
    config = {"model": {"path": str(model_dir)}, "cache": {"kv_dtype": "q4", "capacity": 2048}}
    with serving(loaded, config) as live:
        client = live.client()

        def stream(prompt: str) -> str:
            parts = client.completions.create(model=live.model, prompt=prompt, max_tokens=6, temperature=0, stream=True)
            return "".join(c.choices[0].text for c in parts if c.choices)

        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
            got = list(pool.map(stream, PROMPTS))
        assert got == [samples[0].text for samples in want.outputs] and all(got)

        status, stats = live.get("/stats")
        assert status == 200
        kv, used = stats["kv_bytes"], stats["cells"]["used"]
        # 2 layers x K and V x 2 heads x (64 elements at 4 bits = 32 B + a float16 scale and bias = 4 B).
        assert kv["per_cell"] == 2 * 2 * 2 * 36 and kv["float16_per_cell"] == 2 * 2 * 2 * 128
        assert used > 0 and kv["cells"] == used and kv["held"] == used * 288
        conn = live.connection()
        conn.request("GET", "/metrics")
        text = conn.getresponse().read().decode()
        conn.close()
        metrics = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
        assert metrics["kvlayout_kv_bytes_used"] == kv["held"]
