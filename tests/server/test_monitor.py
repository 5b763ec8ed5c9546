"""/stats, /metrics, the cell map's frames (/cells, /cells/at) and `kvlayout run --trace`, against
what the requests did, hand-worked buckets and a plain-Python reading of the frames."""

from __future__ import annotations

import base64
import json
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvlayout.registry import plugin_manager
from kvlayout.server import cellmap
from tests.server.conftest import serving
from tests.server.test_faults import open_stream

SMALL = {"cache": {"capacity": 2048}}  # at most 4096 cells: one cell per bucket, the map is exact


def first_frame(live) -> dict:
    """The first frame /cells sends (it sends the current one at once)."""
    sock = socket.create_connection(("127.0.0.1", live.port), timeout=10)
    try:
        sock.sendall(b"GET /cells HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        seen = b""
        while b"\n\n" not in seen.split(b"data: ", 1)[-1] or b"data: " not in seen:
            seen += sock.recv(65536)
        return json.loads(seen.split(b"data: ", 1)[1].split(b"\n\n", 1)[0])
    finally:
        sock.close()


def classes_of(frame: dict) -> np.ndarray:
    return np.frombuffer(base64.b64decode(frame["classes"]), np.uint8)


def settled(live) -> dict:
    """/stats once the map has drawn the last step."""
    return poll(lambda: (s := live.get("/stats")[1])["map_step"] == s["steps"] and s, "the map drew the last step")


def test_after_two_requests_sharing_a_prefix_stats_show_it_kept_and_the_tokens_it_saved(tiny_loaded):
    with serving(tiny_loaded, SMALL) as live:
        shared = "a system prompt that both requests share, " * 3
        client = live.client()
        a = client.completions.create(model="tiny", prompt=shared + "first", max_tokens=5, temperature=0)
        b = client.completions.create(model="tiny", prompt=shared + "second", max_tokens=5, temperature=0)
        s = settled(live)
        assert b.usage.prompt_tokens_details.cached_tokens > len(shared) - 16
        assert s["saved_prefill_tokens"] == b.usage.prompt_tokens_details.cached_tokens
        assert s["prefill_tokens"] == a.usage.prompt_tokens + b.usage.prompt_tokens - s["saved_prefill_tokens"]
        assert s["generated_tokens"] == a.usage.completion_tokens + b.usage.completion_tokens
        c = s["cells"]
        assert c["live_sequences"] == 0 and c["shared_live"] == 0 and s["queue"] == {"running": 0, "waiting": 0}
        # The shared prefix is held once for both kept answers: exactly the tokens the second reused.
        assert c["shared"] == b.usage.prompt_tokens_details.cached_tokens > 0
        assert c["cached"] == c["used"] > 0 and c["used"] + c["free"] == c["capacity"] == 2048
        # Each answer's cells are kept: its prompt and what it fed back, the shared part once.
        fed = [r.usage.prompt_tokens + r.usage.completion_tokens - (r.choices[0].finish_reason == "length")
               for r in (a, b)]
        assert c["used"] == sum(fed) - b.usage.prompt_tokens_details.cached_tokens
        assert s["prefix_cache"]["entries"] == 2


class SlowModel:
    """The tiny model, a forward taking at least `delay` s: a request stays running while a test looks."""

    def __init__(self, model, delay: float = 0.05):
        self.model, self.delay = model, delay

    def __getattr__(self, name):
        return getattr(self.model, name)

    def __call__(self, *args, **kwargs):
        time.sleep(self.delay)
        return self.model(*args, **kwargs)


def poll(predicate, what: str, bound_s: float = 20.0):
    """`predicate()` once it is truthy, asking every 0.1 s (a test server takes a bounded number of requests)."""
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.1)
    raise AssertionError(f"not within {bound_s} s: {what}")


def test_forks_of_a_running_request_show_as_shared_cells_of_two_live_sequences(tiny_loaded):
    with serving(tiny_loaded, SMALL, model=SlowModel(tiny_loaded[0])) as live:
        prompt = "one prompt, two samples: its cells are shared by both forks " * 2
        sock = open_stream(live, {"prompt": prompt, "max_tokens": 200, "n": 2, "temperature": 1.0})
        try:
            s = poll(lambda: (x := live.get("/stats")[1])["cells"]["live_sequences"] == 2 and x, "two forks live")
            assert s["cells"]["shared_live"] >= len(prompt) - 1  # the prompt, owned by both (and the kept copy)
            frame = first_frame(live)
            cls = classes_of(frame)
            assert np.count_nonzero(cls) == frame["used"] and frame["bucket"] == 1
            assert np.count_nonzero(cls == cellmap.CLASS_SHARED) == frame["shared_live"] <= frame["shared"]
            seqs_drawn = {int(c) - cellmap.CLASS_SEQ0 for c in np.unique(cls) if c >= cellmap.CLASS_SEQ0}
            assert seqs_drawn <= set(frame["live"])
        finally:
            sock.close()


def test_metrics_are_prometheus_text_with_the_values_stats_has(tiny_loaded):
    with serving(tiny_loaded, SMALL) as live:
        live.client().completions.create(model="tiny", prompt="x" * 40, max_tokens=4)
        s = settled(live)
        conn = live.connection()
        conn.request("GET", "/metrics")
        resp = conn.getresponse()
        assert resp.status == 200 and resp.getheader("content-type").startswith("text/plain")
        samples = {x.name: x.value for f in text_string_to_metric_families(resp.read().decode()) for x in f.samples}
        assert samples["kvlayout_cells_used"] == s["cells"]["used"]
        assert samples["kvlayout_cells_capacity"] == 2048
        assert samples["kvlayout_steps_total"] == s["steps"]
        assert samples["kvlayout_generated_tokens_total"] == s["generated_tokens"]
        assert samples["kvlayout_requests_waiting"] == 0
        # engine.speculate is off by default: counted, and nothing drafted.
        assert samples["kvlayout_drafted_tokens_total"] == s["drafted_tokens"] == 0
        assert samples["kvlayout_accepted_tokens_total"] == s["accepted_tokens"] == 0


def test_a_cell_is_looked_up_by_number_and_a_bad_number_is_refused(tiny_loaded):
    with serving(tiny_loaded, SMALL) as live:
        live.client().completions.create(model="tiny", prompt="y" * 40, max_tokens=3)
        settled(live)
        status, body = live.get("/cells/at?cell=0")
        assert status == 200 and body["position"] == 0 and body["cached"] and len(body["owners"]) == 1
        status, body = live.get("/cells/at?cell=2047")
        assert status == 200 and body == {"cell": 2047, "position": None, "owners": [], "cached": False}
        for bad in ("-1", "x", "2048", "", "%C2%B2", "9" * 5000):  # "²" is a digit to str.isdigit
            status, body = live.get(f"/cells/at?cell={bad}")
            assert status == 400 and body["error"]["param"] == "cell"


def test_a_seq_layout_has_no_map_and_says_so(tiny_loaded):
    with serving(tiny_loaded, {"layout": {"backend": "mlx", "kind": "seq"}, "server": {"max_sequences": 4}}) as live:
        status, body = live.get("/cells/at?cell=0")
        assert status == 404 and "no cells to show" in body["error"]["message"]
        assert live.get("/stats")[1]["cells"]["live_sequences"] == 0


def test_the_observer_leaves_the_plugin_manager_with_its_server(tiny_loaded):
    with serving(tiny_loaded, SMALL) as live:
        name = live.service.worker.observer.name
        assert plugin_manager().has_plugin(name)
    assert not plugin_manager().has_plugin(name)


class View:
    """A CellView over a hand-made table."""

    def __init__(self, capacity, cells, owners):
        self.capacity, self.max_seqs = capacity, len(owners[0])
        self.cells, self.owners = np.array(cells), np.array(owners, bool)

    def cell_owners(self):
        return self.cells, np.arange(len(self.cells)), self.owners


def test_cell_classes_by_hand():
    # cell 0: seq 0 alone; 1: seqs 0 and 1; 2: seq 1 and kept id 3; 3: kept id 3 alone; 5: seq 2 alone.
    view = View(8, [0, 1, 2, 3, 5], [[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 0, 1], [0, 0, 0, 1], [0, 0, 1, 0]])
    classes, counts = cellmap.cell_classes(cellmap.take(view, [3]))
    seq = cellmap.CLASS_SEQ0
    assert classes.tolist() == [seq + 0, cellmap.CLASS_SHARED, seq + 1, cellmap.CLASS_CACHED, 0, seq + 2, 0, 0]
    assert counts == {"used": 5, "free": 3, "live": [0, 1, 2], "cached": 1, "shared": 2, "shared_live": 1}


def test_downsampling_keeps_the_most_common_occupied_class_and_never_hides_occupancy():
    classes = np.array([0, 0, 1, 3, 0, 0, 0, 0, 2, 2, 3, 0, 0, 0, 0, 5], np.uint8)
    buckets, bucket = cellmap.downsample(classes, max_buckets=4)
    assert bucket == 4 and buckets.tolist() == [1, 0, 2, 5]  # a tie goes to the lower class
    buckets, bucket = cellmap.downsample(np.zeros(10_000, np.uint8), max_buckets=4096)
    assert bucket == 3 and buckets.size == 3334  # ceil(10000 / 3)


def trace_frames(path) -> list[dict]:
    html = path.read_text()
    start = html.index("const FRAMES = ") + len("const FRAMES = ")
    return json.JSONDecoder().raw_decode(html[start:])[0]


def test_run_trace_writes_a_frame_before_every_step_and_after_the_last(tmp_path):
    model = tmp_path / "tiny"
    subprocess.run([sys.executable, "-m", "kvlayout.cli", "init-model", str(model), "--preset", "tiny"], check=True,
                   capture_output=True)
    out = tmp_path / "trace.html"
    done = subprocess.run([sys.executable, "-m", "kvlayout.cli", "run", "--model", str(model), "--prompt", "hello",
                           "--max-tokens", "5", "--json", "--trace", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    steps = json.loads(done.stdout)["stats"]["steps"]
    frames = trace_frames(out)
    assert [f["step"] for f in frames] == list(range(steps + 1))
    assert frames[0]["used"] == 0 and frames[-1]["used"] == 0  # nothing before; every sequence freed after
    assert max(f["used"] for f in frames) > 0
    for f in frames:
        assert np.count_nonzero(classes_of(f)) == f["used"] or f["bucket"] > 1


@pytest.mark.parametrize("args, words", [
    (["--layout", "mlx:seq"], "has none"),
    (["--trace", "/nonexistent-dir/t.html"], "does not exist"),
])
def test_a_trace_that_cannot_be_drawn_or_written_is_refused_before_the_run(tmp_path, args, words):
    model = tmp_path / "tiny"
    subprocess.run([sys.executable, "-m", "kvlayout.cli", "init-model", str(model), "--preset", "tiny"], check=True,
                   capture_output=True)
    argv = ["--trace", str(tmp_path / "t.html"), *args] if args[0] != "--trace" else args
    done = subprocess.run([sys.executable, "-m", "kvlayout.cli", "run", "--model", str(model), "--prompt", "hi", *argv],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and words in done.stderr.splitlines()[-1] and "Traceback" not in done.stderr
