"""`kvlayout bench`: finds bench/ in the checkout, refuses clearly without it, writes JSON and a PNG."""

from __future__ import annotations

import json
import struct
import zlib

from kvlayout import cli


def test_bench_without_the_suite_says_where_it_looked(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cli, "bench_dir", lambda: tmp_path / "bench")
    assert cli.main(["bench", "--quick"]) == 2
    err = capsys.readouterr().err
    assert "the benchmark suite is not here" in err and str(tmp_path / "bench" / "suite.py") in err


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
    width, height = struct.unpack(">II", png[16:24])
    assert width > 100 and height > 3 * 14
    (length,) = struct.unpack(">I", png[33:37])  # the IDAT chunk after the 25-byte IHDR chunk
    raw = zlib.decompress(png[41 : 41 + length])
    assert len(raw) == height * (1 + 3 * width)  # one filter byte + RGB per row
