"""The suite: which rows there are, and running some of them in one mode into a table, JSON and a plot.

Each row's table lines are printed as soon as it finishes, and with --out bench.json and bench.png are
rewritten then, so a run stopped part way (Ctrl-C, or killed) keeps every row it finished.
"""

from __future__ import annotations

import json
import platform
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx

from kvlayout import persist
from kvlayout.bench import peers, plot
from kvlayout.bench.cell_rows import row_bookkeep, row_grouped
from kvlayout.bench.dtype_rows import row_fp16
from kvlayout.bench.host_rows import row_host
from kvlayout.bench.kvq_rows import row_kvq
from kvlayout.bench.model_rows import row_batch, row_generate, row_prefix
from kvlayout.bench.progress import RowProgress
from kvlayout.bench.real_rows import row_chat, row_decode, row_lockstep
from kvlayout.bench.record import Row, Section
from kvlayout.bench.serve_rows import row_serve
from kvlayout.bench.shape_rows import row_shapes
from kvlayout.bench.sizes import SIZES
from kvlayout.bench.table import print_header, print_lines, print_workloads
from kvlayout.bench.write_rows import row_write
from kvlayout.errors import ConfigError
from kvlayout.runner import blas

# A row takes its mode's sizes and a context shared by the rows of one run (the model directory,
# the loaded model) and returns its workload, in words, and its table lines.
RowFn = Callable[[dict, dict], tuple[str, list[Row]]]

ROWS: dict[str, RowFn] = {
    "write": row_write,
    "generate": row_generate,
    "batch": row_batch,
    "prefix": row_prefix,
    "bookkeep": row_bookkeep,
    "grouped": row_grouped,
    "fp16": row_fp16,
    "host": row_host,  # row 14: host time per decode step vs mlx-lm's generate_step and BatchGenerator
    "decode": row_decode,  # rows 8, 9 and 13 measure the model of --model DIR
    "chat": row_chat,
    "lockstep": row_lockstep,  # row 13: a batched decode step of the user's model vs mlx-lm's batch
    "serve": row_serve,  # row 10: `kvlayout bench serve`, on --model DIR or SmolLM2
    "kvq": row_kvq,  # row 11: `kvlayout bench kvq`, quantized K/V on a tiny model and --model DIR or SmolLM2
    "shapes": row_shapes,  # row 12: decode attention vs the ideal for every head shape and history
}
ON_A_USER_MODEL = ("decode", "chat", "lockstep")
ON_REQUEST = ("serve", "kvq", "shapes")  # run only when named: minutes each (two servers; SmolLM2 at 32 sequences)
MEASURED_AGAINST_MLX_LM = ("write", "generate", "batch", "prefix", "host", *ON_A_USER_MODEL, *ON_REQUEST)


def heading(mode: str) -> str:
    """What the figures were measured with: the table's first line and the plot's title."""
    return (f"kvlayout bench ({mode}) · mlx {mx.__version__} on {mx.default_device()} · "
            f"mlx-lm {peers.mlx_lm_version()} · {platform.machine()}, {platform.system()} · BLAS: {blas.in_use()}")


def run_suite(mode: str = "default", rows: list[str] | None = None, out: Path | None = None,
              model: Path | None = None) -> dict:
    """Run `rows` at `mode`'s sizes; print the table, a row's lines as it finishes; return the JSON payload.

    Rows default to rows 1-7 and 14 (seeded tiny models), or, with `model` (a model
    directory the user has), to rows 8, 9 and 13 on it (`ON_A_USER_MODEL`). Row 10
    (`serve`) and row 11 (`kvq`) run only when named, on `model` or else SmolLM2.

    With `out`, also write bench.json and bench.png there, rewritten after each
    row; the payload's `rows_pending` names the rows not measured yet. A Ctrl-C
    stops the run: the rows that finished keep their lines, workloads and files,
    one line on stderr says where it stopped, and `rows_pending` is not empty
    (what tells a caller it was stopped). ConfigError (one line, before anything
    runs) for an unknown row; MissingExtra, before anything is measured, when
    mlx-lm (for the rows measured against it) or matplotlib (for `out`) is not
    installed.
    """
    z = SIZES[mode]
    keys = chosen_rows(rows, model, out)
    title = heading(mode)
    print(title)
    print_header()
    sections: list[Section] = []
    saved = 0  # how many of `sections` the files in `out` hold
    try:
        with tempfile.TemporaryDirectory(prefix="kvlayout-bench-") as tmp, RowProgress(keys) as progress:
            # The tiny preset is written by the first row that loads it; --model's directory is read as it is.
            ctx: dict = {"model_dir": Path(tmp) / "tiny", "user_model": model}
            for key in keys:
                progress.running(key)
                t0 = time.perf_counter()
                work, got = ROWS[key](z, ctx)
                progress.finished(key, time.perf_counter() - t0)
                sections.append(Section(key, work, got))
                print_lines(sections[-1])
                if out is not None:
                    save(out, payload(mode, z, sections, keys), sections, title)
                    saved = len(sections)
    except KeyboardInterrupt:
        pass  # what finished is printed and saved below; rows_pending says what did not
    print_workloads(sections)
    result = payload(mode, z, sections, keys)
    if out is not None and saved < len(sections):  # the stop came while the last row's files were written
        save(out, result, sections, title)
    if out is not None and sections:
        print(f"wrote {out / 'bench.json'} and {out / 'bench.png'}")
    if result["rows_pending"]:
        print(stopped_line(sections, result["rows_pending"], out), file=sys.stderr, flush=True)
    return result


def chosen_rows(rows: list[str] | None, model: Path | None, out: Path | None) -> list[str]:
    """The rows to run (`rows`, else the default for `model`), checked before anything runs: ConfigError
    for an unknown row or a model row without `model`; MissingExtra for a missing extra."""
    keys = rows or (list(ON_A_USER_MODEL) if model is not None
                    else [k for k in ROWS if k not in ON_A_USER_MODEL + ON_REQUEST])
    unknown = [k for k in keys if k not in ROWS]
    if unknown:
        raise ConfigError(f"--rows {','.join(unknown)}: expected some of {', '.join(ROWS)}")
    against = [k for k in keys if k in MEASURED_AGAINST_MLX_LM]
    if against:
        peers.require("mlx_lm", f"kvlayout bench (rows {', '.join(against)})", package="mlx-lm")
    if out is not None:
        plot.require()
    needs_model = [k for k in keys if k in ON_A_USER_MODEL]
    if needs_model and model is None:
        raise ConfigError(f"--rows {','.join(needs_model)}: these rows measure a model you have; give --model DIR")
    if model is not None and not Path(model).is_dir():
        raise ConfigError(f"--model {model}: not a directory; expected a model directory (config.json, *.safetensors)")
    return keys


def payload(mode: str, z: dict, sections: list[Section], keys: list[str]) -> dict:
    """bench.json: what ran it, the sizes, each finished row's results, and the rows not measured yet."""
    done = [s.key for s in sections]
    return {
        "mode": mode, "mlx": mx.__version__, "device": str(mx.default_device()), "machine": platform.machine(),
        "blas": blas.in_use(),
        "sizes": z,
        "rows": [{"key": s.key, "workload": s.workload, "results": [r.to_json() for r in s.rows]} for s in sections],
        "rows_pending": keys[len(done):],
    }


def save(out: Path, result: dict, sections: list[Section], title: str) -> None:
    """bench.json (`result`) and bench.png (`sections`' lines) in `out`, each replaced whole: a stop while
    writing leaves the previous one."""
    out.mkdir(parents=True, exist_ok=True)
    persist.write_atomic(out / "bench.json", [json.dumps(result, indent=2).encode()])
    plot.save(out / "bench.png", [r for s in sections for r in s.rows], title)


def stopped_line(sections: list[Section], pending: list[str], out: Path | None) -> str:
    """The one stderr line of a stopped run: the row it stopped in and where the finished ones are."""
    if not sections:
        return f"kvlayout: bench interrupted in row {pending[0]}; no row had finished, nothing was kept"
    done = ", ".join(s.key for s in sections)
    where = "the table above" + (f" and {out / 'bench.json'}" if out is not None else "")
    return f"kvlayout: bench interrupted in row {pending[0]}; the rows that finished ({done}) are in {where}"
