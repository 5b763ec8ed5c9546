"""The one table the suite prints: a line per Row, then what each row's workload was.

It is printed in pieces so that a row's lines appear as soon as the row
finishes: `print_header` before the first row, `print_lines` after each,
`print_workloads` at the end (after a stop too, for the rows that finished).
"""

from __future__ import annotations

import statistics
import sys

from kvlayout.bench.record import Section

HEADER = (f"{'row':<11} {'case':<38} {'A':<14} {'A min':>8} {'A med':>8} {'B':<24} {'B min':>8} {'B med':>8} "
          f"{'A/B':>7}")


def fmt_s(x: float) -> str:
    """Seconds in the unit that keeps them short: 85us, 1.1ms, 2.40s."""
    if x < 1e-3:
        return f"{x * 1e6:.0f}us"
    if x < 1:
        return f"{x * 1e3:.1f}ms"
    return f"{x:.2f}s"


def print_header() -> None:
    print(HEADER)
    print("-" * len(HEADER), flush=True)


def print_lines(section: Section) -> None:
    """One row's lines, flushed: a reader of a pipe or a log sees them before the next row starts."""
    for r in section.rows:
        print(f"{r.row:<11} {r.case:<38.38} {r.a:<14.14} {fmt_s(min(r.a_times)):>8} "
              f"{fmt_s(statistics.median(r.a_times)):>8} {r.b:<24.24} {fmt_s(min(r.b_times)):>8} "
              f"{fmt_s(statistics.median(r.b_times)):>8} {r.ratio:>7.3f}")
        if r.note:
            print(f"{'':<11} {r.note}")
    sys.stdout.flush()


def print_workloads(sections: list[Section]) -> None:
    print("")
    print("workloads (A/B = median time of A / median time of B; below 1: A is faster):")
    for section in sections:
        print(f"  {section.key}: {section.workload}")
