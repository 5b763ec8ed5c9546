"""`kvlayout serve` on the architectures beyond Llama: concurrent streams sharing a prompt prefix get
what `kvlayout run` gives each (itself checked against mlx-lm in tests/models/test_families.py), and
the shared prefix is served from the cache (windows, sinks and experts included)."""

from __future__ import annotations

import concurrent.futures

import pytest

from kvlayout.models.loading import load_model
from kvlayout.runner import job
from tests.models.families import ALL, write_checkpoint
from tests.runner.conftest import make_config
from tests.server.conftest import serving

PREFIX = [(11 * i) % 256 for i in range(24)]  # longer than the rows' windows
PROMPTS = [PREFIX + [40 + i] * (i + 1) for i in range(3)]


@pytest.mark.parametrize("name", ["gemma3_text", "gpt_oss", "qwen3_moe_q4_mixed"])
def test_streams_sharing_a_prefix_equal_kvlayout_run(tmp_path, name):
    model_dir = write_checkpoint(tmp_path / name, ALL[name])
    model, args, tok = load_model(model_dir)
    loaded = (model, args, tok, str(model_dir))
    requests = [{"prompt_ids": p, "max_tokens": 6} for p in PROMPTS]
    want = job.run(make_config(model_dir, "mlx:cell", requests=requests), loaded=loaded)
    config = {"model": {"path": str(model_dir)}, "cache": {"capacity": 2048}}
    with serving(loaded, config) as live:
        client = live.client()
        first = client.completions.create(model=live.model, prompt=PROMPTS[0], max_tokens=6, temperature=0)
        again = client.completions.create(model=live.model, prompt=PROMPTS[1], max_tokens=6, temperature=0)
        cached = again.usage.prompt_tokens_details.cached_tokens
        assert cached == len(PREFIX)  # the shared prefix came from the cache, windows or not

        def stream(prompt: list[int]) -> str:
            parts = client.completions.create(model=live.model, prompt=prompt, max_tokens=6, temperature=0, stream=True)
            return "".join(c.choices[0].text for c in parts if c.choices)

        with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
            got = list(pool.map(stream, PROMPTS))
        texts = [s[0].text for s in want.outputs]
        assert [first.choices[0].text, again.choices[0].text, *got] == [texts[0], texts[1], *texts]
        cells, kv = (stats := live.get("/stats")[1])["cells"], stats["kv_bytes"]
    windowed = [i for i in range(args.num_hidden_layers) if args.layer_configs()[i].policy.window]
    if windowed:  # the window layers hold their own table's cells, fewer than the flat layers'
        # Every layer of these rows has one K/V shape: the window layers' share of a cell is theirs in number.
        assert kv["window_per_cell"] * args.num_hidden_layers == kv["per_cell"] * len(windowed)
        assert 0 < cells["window_used"] <= cells["used"]  # kept prompts are pinned whole (prefix reuse)
        assert kv["held"] == (kv["per_cell"] - kv["window_per_cell"]) * cells["used"] + (
            kv["window_per_cell"] * cells["window_used"])
    else:
        assert "window_used" not in cells and kv["held"] == kv["per_cell"] * cells["used"]
