"""What `kvlayout run` prints: whole outputs, wrapped to the width, and no control codes off a terminal."""

from __future__ import annotations

import io
import re

from rich.cells import cell_len
from rich.console import Console

from kvlayout.engines.records import Request, Stats
from kvlayout.runner.records import RunResult, SampleResult, TextEvent
from kvlayout.runner.report import LiveText, print_report, printable

CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")  # anything but \t and \n; \x1b starts every escape
LONG = (
    "Paris is the capital of France, and it has been for a very long time; its river is the Seine. "
    "Averyveryverylongwordwithoutanyspacesthatmustbefoldedratherthancutoffattheedge "
    "日本語のテキストも折り返されます 😀🎉 and café crème.\nA second line\tafter a tab."
)
NASTY = "bell\x07 escape\x1b[31m red\x1b[0m carriage\rreturn \ufffd"


def result() -> RunResult:
    requests = [Request(0, [1] * 40, 64, 2), Request(1, [2] * 9, 64, 1)]
    outputs = [
        [SampleResult([5] * 64, LONG, "length"), SampleResult([6] * 3, "Paris.", "stop")],
        [SampleResult([7] * 20, NASTY, "length")],
    ]
    stats = Stats(layout="mlx:cell", kv_dtype="float32", model="SmolLM2-135M-Instruct", steps=3)
    messages = [
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the capital of France?"}],
        None,
    ]
    return RunResult(requests, outputs, stats, ["<rendered chat>", "a plain prompt"], True, messages)


def plain_report(width: int = 80) -> str:
    out = io.StringIO()
    print_report(result(), Console(file=out, width=width))  # a file, not a terminal
    return out.getvalue()


def text_column(report: str) -> str:
    """The table's last column, every row's cell joined, whitespace dropped."""
    cells = [line.split("│")[-2] for line in report.splitlines() if line.startswith("│")]
    return "".join("".join(cells).split())


def test_off_a_terminal_the_report_has_no_control_codes_and_fits_80_columns():
    report = plain_report()
    assert not CONTROL.search(report)
    assert max(cell_len(line) for line in report.splitlines()) <= 80


def test_every_output_is_whole_in_the_table_wrapped_not_cut():
    column = text_column(plain_report())
    for text in (LONG, "Paris.", printable(NASTY), "What is the capital of France?", "a plain prompt"):
        assert "".join(text.split()) in column
    assert "…" not in plain_report()


def test_model_output_cannot_reach_the_terminal_as_control_codes():
    assert printable(NASTY) == "bell· escape·[31m red·[0m carriage·return \ufffd"
    assert printable("a\tb\nc") == "a    b\nc"


def test_a_chat_request_shows_its_last_message_and_a_plain_one_its_prompt():
    report = plain_report()
    assert "What is the capital of France?" in report and "<rendered chat>" not in report
    assert "a plain prompt" in report


def test_the_live_view_shows_each_sample_s_text_so_far_and_which_ended():
    out = io.StringIO()
    console = Console(file=out, width=80, height=30, force_terminal=True)
    live = LiveText("mlx:cell · tiny", ["What is the capital?", "Why?"], [2, 1], 30, console)
    for event in [
        TextEvent(0, 0, 1, "Paris is"),
        TextEvent(0, 1, 2, "It is"),
        TextEvent(0, 0, 3, " the capital.", "stop"),
        TextEvent(1, 0, 4, "Because\nit is."),
    ]:
        live.on_text(event)
    live.advance(4)
    console.print(live)
    shown = re.sub(r"\x1b\[[0-9;]*m", "", out.getvalue())
    assert "Paris is the capital. [stop]" in shown
    assert "It is ▌" in shown and "Because ⏎ it is. ▌" in shown
    assert "4/30 tokens" in shown
    assert max(cell_len(line) for line in shown.splitlines()) <= 80


def test_no_failed_sample_no_failure_line():
    from kvlayout.runner.report import failure_line

    assert failure_line(result()) is None


def test_the_failure_line_counts_the_failed_samples_and_gives_the_first_reason_in_one_line():
    import attrs

    from kvlayout.runner.report import failure_line

    full = result()
    policy = "plugin 'p' from kvlayout-x 1.0: kvlayout_choose_cells answered [0, 0]: expected 2 distinct cells"
    outputs = [
        [SampleResult([], "", "error", policy), SampleResult([6], "P", "stop")],
        [SampleResult([], "", "error", "MemoryError: out of\nmemory")],
    ]
    line = failure_line(attrs.evolve(full, outputs=outputs))
    assert line == f"2 of 3 samples failed: {policy} (and 1 other reason(s); --json has each sample's)"
    same = [[SampleResult([], "", "error", policy)] * 2, [SampleResult([], "", "error", policy)]]
    assert failure_line(attrs.evolve(full, outputs=same)) == f"3 of 3 samples failed: {policy}"
    lone = [[SampleResult([], "", "error", "MemoryError: out of\nmemory"), SampleResult([6], "P", "stop")], []]
    assert failure_line(attrs.evolve(full, outputs=lone)) == "1 of 2 samples failed: MemoryError: out of memory"
