"""The bench suite as a package of kvlayout: its plot, its cell layouts, its manners, its wheel."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import numpy as np

import kvlayout.bench
from kvlayout.bench import plot
from kvlayout.bench.cell_rows import interleaved_cells
from kvlayout.bench.layouts import cell_table
from kvlayout.bench.record import Row

ROOT = Path(__file__).resolve().parents[2]
BENCH = Path(kvlayout.bench.__file__).parent


def some_rows() -> list[Row]:
    return [
        Row("1 write", "1 token @1k: seq", "seq", "mlx-lm", [2.0, 3.0], [1.0, 1.0]),
        Row("6 grouped", "decode step: layout / ideal", "layout", "ideal", [1.0], [1.25]),
        Row("6 grouped", "decode step: layout / dense", "layout", "dense", [0.004], [1.0]),
    ]


def test_plot_labels_each_bar_by_row_and_case_on_a_log_axis_marked_at_equal():
    rows = some_rows()
    fig = plot.figure(rows, "kvlayout bench (quick) · mlx 0.0 on cpu")
    [ax] = fig.axes
    fig.canvas.draw()  # tick labels are laid out at draw time
    expected = ["1 write · 1 token @1k: seq", "6 grouped · decode step: layout / ideal",
                "6 grouped · decode step: layout / dense"]
    by_y = sorted((t.get_position()[1], t.get_text()) for t in ax.get_yticklabels())
    assert [text for _, text in by_y] == expected
    assert ax.get_ylim()[0] > ax.get_ylim()[1]  # inverted: the first table line is the top bar
    assert ax.get_xscale() == "log" and ax.get_title() == "kvlayout bench (quick) · mlx 0.0 on cpu"
    assert any(list(line.get_xdata()) == [1.0, 1.0] for line in ax.get_lines())  # the vertical line at 1
    texts = [t.get_text() for t in ax.texts]
    assert "equal" in texts
    assert "2.50  seq / mlx-lm" in texts and "0.80  layout / ideal" in texts and "0.004  layout / dense" in texts
    bars = sorted(ax.patches, key=lambda p: p.get_y())
    ends = [p.get_x() + p.get_width() for p in bars]  # each bar runs from 1 to its ratio
    assert np.allclose(ends, [2.5, 0.8, 0.004]) and all(p.get_x() == 1.0 for p in bars)


def test_interleaved_cells_give_sequence_s_the_cells_s_plus_multiples_of_the_count():
    cache, control = interleaved_cells(256, 64, np.random.default_rng(0))
    assert control.used_end == 256
    for s in (0, 5, 63):
        cells, positions = cell_table(cache).seq_cells(s)
        assert cells.tolist() == list(range(s, 256, 64)) and positions.tolist() == [0, 1, 2, 3]


def test_the_bench_reaches_no_underscored_name_of_another_module():
    reaches = []
    for path in sorted(BENCH.glob("*.py")) + sorted((ROOT / "bench").glob("*.py")):  # the suite, the scripts
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.attr] if isinstance(node, ast.Attribute) else []
            if isinstance(node, ast.ImportFrom) and not (node.module or "").startswith("kvlayout.bench"):
                names = [alias.name for alias in node.names]
            reaches += [f"{path.name}:{node.lineno} {n}" for n in names if n.startswith("_") and not n.startswith("__")]
    assert reaches == []


def test_a_wheel_of_kvlayout_carries_the_bench_suite(tmp_path):
    src = tmp_path / "src"  # a clean copy: no build/ or egg-info of the checkout goes into the wheel
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "core", src / "core", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    t0 = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", str(src), "-w",
         str(tmp_path / "dist")],
        check=True, capture_output=True,
    )
    assert time.perf_counter() - t0 < 60
    [wheel] = (tmp_path / "dist").glob("kvlayout-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {"kvlayout/bench/__init__.py", "kvlayout/bench/suite.py", "kvlayout/bench/plot.py"} <= names


def test_the_user_model_rows_measure_a_given_directory_beside_mlx_lm_with_identical_tokens(tmp_path, capsys):
    # A directory mlx-lm itself wrote (convert -q), with a tokenizer: both sides load it, get the same
    # prompt ids, and must agree token for token (the rows' own oracle, mlx-lm, reports it).
    from kvlayout.bench import suite
    from tests.models.quantized import convert_tiny

    model_dir = convert_tiny(tmp_path / "q4", bits=4, group_size=32)
    payload = suite.run_suite("quick", out=None, model=model_dir)
    rows = {r["key"]: r["results"] for r in payload["rows"]}
    assert list(rows) == ["decode", "chat", "lockstep"]  # with --model, the default rows are the model's
    # mlx:seq, mlx:cell vs mlx-lm; mlx:seq drawing ahead vs its host path
    assert [r["identical"] for r in rows["decode"]] == [True, True, True]
    assert [r["identical"] for r in rows["chat"]] == [True]
    assert all(r["tok_s"] > 0 and r["baseline_tok_s"] > 0 for key in ("decode", "chat") for r in rows[key])
    # N sequences in lockstep against mlx-lm's own model and cache on the same [N, L] batch
    assert [(r["identical"], r["seqs"], r["prompt"]) for r in rows["lockstep"]] == [(True, 4, 32)]
    assert "8 decode" in capsys.readouterr().out


def test_the_user_model_rows_without_a_model_are_refused_in_one_line(capsys):
    from kvlayout import cli

    assert cli.main(["bench", "--quick", "--rows", "chat"]) == 2
    assert capsys.readouterr().err == (
        "kvlayout: error: --rows chat: these rows measure a model you have; give --model DIR\n")


def test_the_user_model_rows_take_a_directory_without_a_tokenizer(tmp_path):
    # The tiny preset has no tokenizer.json: prompts come from kvlayout's byte tokenizer instead.
    from kvlayout.bench import suite
    from kvlayout.models.presets import write_preset

    payload = suite.run_suite("quick", ["decode"], model=write_preset(tmp_path / "tiny", "tiny"))
    [row] = payload["rows"]
    assert [r["identical"] for r in row["results"]] == [True, True, True]


def test_the_host_row_times_both_sides_with_identical_tokens_and_puts_async_eval_back():
    # Row 14 replaces mx.async_eval while it counts its time; whatever happens, the original is back.
    # Its oracle is mlx-lm's own loops on the same directory: the same tokens, or the figures mean nothing.
    import mlx.core as mx

    from kvlayout.bench import suite
    from kvlayout.bench.host_rows import AsyncEvalClock

    real, clock = mx.async_eval, AsyncEvalClock()
    try:
        with clock.timing():
            mx.async_eval(mx.ones(3) * 2)
            assert mx.async_eval is not real
            raise KeyError("inside")
    except KeyError:
        pass
    assert mx.async_eval is real and clock.seconds > 0
    payload = suite.run_suite("quick", rows=["host"])
    (row,) = payload["rows"]
    results = row["results"]
    assert [r["case"] for r in results] == [
        "1 seq, 2 layers: mlx:seq", "1 seq, 2 layers: mlx:cell", "1 seq, 8 layers: mlx:seq",
        "1 seq, 8 layers: mlx:cell", "8 seqs, 2 layers: mlx:cell host"]
    assert all(r["identical"] for r in results)
    assert all(r["host_ms"] > 0 and r["baseline_host_ms"] > 0 for r in results)
    assert all(r["opcodes"] > 0 and r["baseline_opcodes"] > 0 for r in results)  # each side's opcodes a step
    assert set(results[3]["split"]) == {"mlx:seq", "mlx:cell", "mlx-lm"}
    assert mx.async_eval is real


def test_the_opcode_count_is_exact_and_leaves_any_tracer_in_place():
    # Counted, not timed: a loop's count grows by the same number of bytecodes per iteration, run after run;
    # a tracer set before (a debugger's, coverage's) is set again after.
    import sys

    from kvlayout.bench.host_rows import opcodes

    def loop(n):
        total = 0
        for i in range(n):
            total += i
        return total

    counts = [opcodes(lambda n=n: loop(n)) for n in (10, 20, 30, 10)]
    assert counts[1] - counts[0] == counts[2] - counts[1] > 0 and counts[3] == counts[0]
    before = sys.gettrace()
    try:
        def mine(frame, event, arg):
            return None

        sys.settrace(mine)
        opcodes(lambda: loop(3))
        assert sys.gettrace() is mine
    finally:
        sys.settrace(before)
