"""`kvlayout bench`: the suite installed with kvlayout; one line and exit 2 for a bad row or a missing extra."""

from __future__ import annotations

import json
import struct
import sys
import zlib

from kvlayout import cli

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
    assert line.startswith("kvlayout: error: ") and "matplotlib" in line and "pip install 'kvlayout[bench]'" in line
    assert captured.out == "" and not list(tmp_path.iterdir())  # nothing measured, nothing written


def test_bench_rows_against_mlx_lm_without_it_say_how_to_install_it(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "mlx_lm", None)
    assert cli.main(["bench", "--quick", "--rows", "fp16,write"]) == 2
    captured = capsys.readouterr()
    [line] = captured.err.splitlines()
    assert "rows write" in line and "mlx-lm" in line and "pip install 'kvlayout[bench]'" in line
    assert captured.out == ""
