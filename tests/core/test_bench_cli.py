"""`kvlayout bench`: the suite installed with kvlayout; one line and exit 2 for a bad row or a missing extra."""

from __future__ import annotations

import json
import re
import struct
import sys
import time
import zlib

import pytest

from kvlayout import cli
from kvlayout.bench import suite
from kvlayout.bench.record import Row

CHANNELS = {2: 3, 6: 4}  # PNG colour type -> bytes per 8-bit pixel: RGB, RGBA


def png_chunks(png: bytes) -> list[tuple[bytes, bytes]]:
    """(type, data) of every chunk, each checked against its CRC."""
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    chunks, at = [], 8
    while at < len(png):
        (length,) = struct.unpack(">I", png[at : at + 4])
        kind, data = png[at + 4 : at + 8], png[at + 8 : at + 8 + length]
        (crc,) = struct.unpack(">I", png[at + 8 + length : at + 12 + length])
        assert zlib.crc32(kind + data) & 0xFFFFFFFF == crc
        chunks.append((kind, data))
        at += 12 + length
    return chunks


def test_bench_refuses_an_unknown_row(capsys):
    assert cli.main(["bench", "--quick", "--rows", "grouped,nope"]) == 2
    assert "--rows nope: expected some of write," in capsys.readouterr().err


def test_bench_quick_row_prints_its_table_and_writes_json_and_png(tmp_path, capsys):
    assert cli.main(["bench", "--quick", "--rows", "grouped", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "6 grouped" in out and "decode step: layout / dense" in out and "workloads" in out
    payload = json.loads((tmp_path / "bench.json").read_text())
    [row] = payload["rows"]
    assert row["key"] == "grouped" and len(row["results"]) == 4
    assert all(r["a_median_s"] > 0 and r["b_median_s"] > 0 for r in row["results"])
    png = (tmp_path / "bench.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and png[12:16] == b"IHDR"
    chunks = png_chunks(png)
    width, height, depth, colour = struct.unpack(">IIBB", chunks[0][1][:10])
    assert width > 100 and height > 3 * 14 and depth == 8
    raw = zlib.decompress(b"".join(data for kind, data in chunks if kind == b"IDAT"))
    assert len(raw) == height * (1 + CHANNELS[colour] * width)  # one filter byte + the pixels per row
    assert chunks[-1][0] == b"IEND"


def test_bench_out_without_matplotlib_says_how_to_install_it_before_measuring(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    assert cli.main(["bench", "--quick", "--rows", "fp16", "--out", str(tmp_path)]) == 2
    captured = capsys.readouterr()
    [line] = captured.err.splitlines()
    assert line.startswith("kvlayout: error: ") and "matplotlib" in line and "pip install -e '.[bench]'" in line
    assert captured.out == "" and not list(tmp_path.iterdir())  # nothing measured, nothing written


def test_bench_rows_against_mlx_lm_without_it_say_how_to_install_it(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "mlx_lm", None)
    assert cli.main(["bench", "--quick", "--rows", "fp16,write"]) == 2
    captured = capsys.readouterr()
    [line] = captured.err.splitlines()
    assert "rows write" in line and "mlx-lm" in line and "pip install -e '.[bench]'" in line
    assert captured.out == ""


def test_bench_serve_and_rows_together_are_refused_in_one_line(capsys):
    assert cli.main(["bench", "serve", "--rows", "grouped"]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert "give one of them" in line


def test_the_serve_row_summarises_wall_time_throughput_and_time_to_first_token_percentiles():
    from kvlayout.bench.serve_rows import rows_of, summary

    answers = [{"ttft": t, "text": "x", "completion_tokens": 10, "prompt_tokens": 100, "cached_tokens": c}
               for t, c in zip([0.1 * i for i in range(1, 101)], [0] + [90] * 99)]
    s = summary({"wall": 20.0, "answers": answers})
    assert s["requests_s"] == 5.0 and s["gen_tok_s"] == 50.0  # 100 requests, 1000 tokens, 20 s
    assert abs(s["ttft_p50_s"] - 5.05) < 1e-9  # the median of 0.1..10.0
    assert abs(s["ttft_p99_s"] - 9.9) < 1e-9  # index round(0.99 * 99) = 98 of the sorted times
    assert (s["cached_tokens"], s["prompt_tokens"]) == (99 * 90, 100 * 100)
    slower = [{**a, "ttft": 2 * a["ttft"], "text": "y" if i % 2 else "x"} for i, a in enumerate(answers)]
    wall, ttft = rows_of(16, {"kvlayout serve": {"wall": 20.0, "answers": answers},
                              "mlx_lm.server": {"wall": 40.0, "answers": slower}})
    assert wall.ratio == 0.5 and "2.00x" in wall.note and "answers identical 50/100" in wall.note
    assert abs(ttft.ratio - 0.5) < 1e-9


def test_the_serve_row_s_system_prompt_is_as_long_as_asked_and_its_own_per_phase():
    from kvlayout.bench.serve_rows import system_prompt
    from kvlayout.models.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    a, b = system_prompt(tok, 512, 1), system_prompt(tok, 512, 16)
    assert 512 <= len(tok.encode(a)) < 512 + 100 and a[:10] != b[:10]


def test_bench_serve_on_a_model_without_a_tokenizer_is_one_line_before_any_server_starts(tmp_path, capsys):
    assert cli.main(["init-model", str(tmp_path / "tiny"), "--preset", "tiny"]) == 0
    capsys.readouterr()
    assert cli.main(["bench", "serve", "--quick", "--model", str(tmp_path / "tiny")]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert "tokenizer.json" in line and str(tmp_path / "tiny") in line


def a_finished_row(z: dict, ctx: dict) -> tuple[str, list[Row]]:
    """A row as the suite's rows return one: medians 2 s (A) and 4 s (B), so A/B is 0.500."""
    return "the first row's workload", [Row("1 first", "a finished case", "fast", "slow", [1.0, 3.0], [4.0, 4.0])]


def never_run(z: dict, ctx: dict) -> tuple[str, list[Row]]:
    raise AssertionError("a row ran after the Ctrl-C")


@pytest.fixture
def no_terminal(monkeypatch):
    """stderr counts as no terminal (rich's TTY_COMPATIBLE), whatever the environment forces."""
    monkeypatch.setenv("TTY_COMPATIBLE", "0")


def test_bench_prints_and_saves_each_row_as_it_finishes_and_a_ctrl_c_keeps_them(tmp_path, monkeypatch, capsys,
                                                                                 no_terminal):
    seen = {}

    def interrupted_row(z, ctx):
        # What a user killing the run here would have: the first row's line printed, its files written.
        seen["out"], seen["err"] = capsys.readouterr()
        seen["json"] = json.loads((tmp_path / "bench.json").read_text())
        seen["png"] = (tmp_path / "bench.png").read_bytes()
        raise KeyboardInterrupt

    monkeypatch.setattr(suite, "ROWS", {"first": a_finished_row, "second": interrupted_row, "third": never_run})
    assert cli.main(["bench", "--quick", "--rows", "first,second,third", "--out", str(tmp_path)]) == 130
    assert seen["err"] == "[first: 0s]\n"  # no terminal: no bar, a line as each row finishes
    [line] = [x for x in seen["out"].splitlines() if x.startswith("1 first")]
    assert "a finished case" in line and line.split()[-1] == "0.500"
    [row] = seen["json"]["rows"]
    assert (row["key"], row["workload"]) == ("first", "the first row's workload")
    [result] = row["results"]
    assert (result["a_median_s"], result["b_median_s"], result["ratio_a_over_b"]) == (2.0, 4.0, 0.5)
    assert seen["json"]["rows_pending"] == ["second", "third"]
    assert png_chunks(seen["png"])[-1][0] == b"IEND"
    captured = capsys.readouterr()
    assert "  first: the first row's workload" in captured.out and "second:" not in captured.out
    assert json.loads((tmp_path / "bench.json").read_text()) == seen["json"]  # the stop kept it as it was
    assert captured.err.splitlines() == [
        f"kvlayout: bench interrupted in row second; the rows that finished (first) are in the table above and "
        f"{tmp_path / 'bench.json'}",
    ]


def test_bench_stopped_before_any_row_finished_writes_nothing_and_says_so(tmp_path, monkeypatch, capsys, no_terminal):
    def interrupted_row(z, ctx):
        raise KeyboardInterrupt

    monkeypatch.setattr(suite, "ROWS", {"first": interrupted_row, "second": never_run})
    assert cli.main(["bench", "--quick", "--rows", "first,second", "--out", str(tmp_path)]) == 130
    assert capsys.readouterr().err.splitlines() == [
        "kvlayout: bench interrupted in row first; no row had finished, nothing was kept"]
    assert not list(tmp_path.iterdir())


def test_bench_on_a_terminal_shows_a_bar_naming_the_row_running(monkeypatch, capsys):
    monkeypatch.setenv("TTY_COMPATIBLE", "1")  # stderr counts as a terminal; stdout (captured) does not

    def slow_row(z, ctx):
        time.sleep(0.5)  # past a few of the bar's redraws (10 a second)
        return a_finished_row(z, ctx)

    monkeypatch.setattr(suite, "ROWS", {"slowrow": slow_row})
    assert cli.main(["bench", "--quick", "--rows", "slowrow"]) == 0
    captured = capsys.readouterr()
    err = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", captured.err)  # the terminal's colours and cursor moves
    assert "kvlayout bench row slowrow" in err and "0/1 rows" in err  # the bar while the row runs
    assert "[slowrow: 1s]" in err  # printed above the bar as the row finished
    assert "a finished case" in captured.out and "a finished case" not in err  # the table stays on stdout


def test_bench_quick_on_a_model_directory_takes_seconds_with_one_repeat_a_side(tmp_path, capsys):
    # The complaint: `--quick --model DIR` ran for minutes. Quick means a smoke test: the three model
    # rows (8, 9, 13) measure each side once, and on the tiny preset the whole command ends within 60 s.
    assert cli.main(["init-model", str(tmp_path / "tiny"), "--preset", "tiny"]) == 0
    t0 = time.perf_counter()
    assert cli.main(["bench", "--quick", "--model", str(tmp_path / "tiny"), "--out", str(tmp_path / "out")]) == 0
    assert time.perf_counter() - t0 < 60
    payload = json.loads((tmp_path / "out" / "bench.json").read_text())
    assert [r["key"] for r in payload["rows"]] == ["decode", "chat", "lockstep"] and payload["rows_pending"] == []
    results = [r for row in payload["rows"] for r in row["results"]]
    assert all(len(r["a_times_s"]) == 1 and len(r["b_times_s"]) == 1 for r in results)
    assert all(r["identical"] for r in results)
    out = capsys.readouterr().out
    assert "8 decode" in out and "9 chat" in out and "13 lockstep" in out
