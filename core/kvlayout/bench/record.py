"""What a row of the suite produces: table lines (Row) under one workload (Section)."""

from __future__ import annotations

import statistics

import attrs


@attrs.define
class Row:
    """One printed line: side A against side B on one case.

    `row` names the suite's row ("6 grouped"), `case` what was measured in it;
    `ratio` is the median time of A over the median time of B (below 1: A is
    faster).
    """

    row: str
    case: str
    a: str
    b: str
    a_times: list[float]
    b_times: list[float]
    note: str = ""
    extra: dict = attrs.Factory(dict)

    @classmethod
    def from_times(cls, row: str, case: str, times: dict[str, list[float]], a: str, b: str, note: str = "",
                   **extra) -> Row:
        """Sides `a` and `b` of what `timing.interleaved` measured; `extra` goes into the JSON."""
        return cls(row, case, a, b, times[a], times[b], note, extra)

    @property
    def ratio(self) -> float:
        return statistics.median(self.a_times) / statistics.median(self.b_times)

    def to_json(self) -> dict:
        return {
            "row": self.row, "case": self.case, "a": self.a, "b": self.b,
            "a_min_s": min(self.a_times), "a_median_s": statistics.median(self.a_times),
            "b_min_s": min(self.b_times), "b_median_s": statistics.median(self.b_times),
            "ratio_a_over_b": self.ratio, "a_times_s": self.a_times, "b_times_s": self.b_times,
            "note": self.note, **self.extra,
        }


@attrs.frozen
class Section:
    """One row of the suite as run: its key (`--rows` name), the workload it states, its lines."""

    key: str
    workload: str
    rows: list[Row]
