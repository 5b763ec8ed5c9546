"""The `kvlayout` command."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from kvlayout import registry
from kvlayout.errors import KVLayoutError


def _plugins(args: argparse.Namespace) -> int:
    pm = registry.plugin_manager()
    builders = registry.available(pm)
    if args.json:
        payload = {
            "layouts": [
                {
                    "backend": b.backend_id,
                    "kind": b.kind,
                    "distribution": b.distribution,
                    "version": b.version,
                    "summary": b.summary,
                }
                for b in builders
            ],
            "failed": [
                {
                    "entry_point": f.entry_point,
                    "distribution": f.distribution,
                    "version": f.version,
                    "error": f.error,
                }
                for f in pm.failures
            ],
        }
        print(json.dumps(payload, indent=2))
        return 0
    console = Console()
    table = Table(title="kvlayout layouts")
    for column in ("backend", "kind", "distribution", "version", "summary"):
        table.add_column(column)
    for b in builders:
        table.add_row(b.backend_id, b.kind, b.distribution or "?", b.version or "?", b.summary)
    console.print(table)
    if not builders:
        console.print("no layouts installed: pip install kvlayout-seq kvlayout-cell")
    for f in pm.failures:
        console.print(
            f"[red]failed[/red] {f.entry_point} from {f.distribution} {f.version}: {f.error}",
            markup=True,
            highlight=False,
        )
    return 0


def _run(args: argparse.Namespace) -> int:
    # Imported here so `kvlayout plugins` never pays for loading the model code.
    from kvlayout.runner import config, report

    from kvlayout.engines.recovery import Interrupted
    from kvlayout.runner.interrupt import StopOnCtrlC
    from kvlayout.runner.job import prepare

    cfg = config.load_config(args.config)
    if args.layout:
        cfg = cfg.with_layout(args.layout)
    job = prepare(cfg, resume=args.resume)  # every user error surfaces here, before the progress bar
    for notice in job.notices:  # a fallback model, chat sent as plain text: said before the run
        print(f"kvlayout: {notice}", file=sys.stderr)
    save = args.save_state
    # With --save-state, a first Ctrl-C stops the run after its current step and saves it.
    stop = StopOnCtrlC() if save else None
    again = f"continue with: kvlayout run {args.config or ''} --resume {save}".replace("  ", " ")
    try:
        with stop or contextlib.nullcontext(), report.progress_bar(job.planned_tokens, cfg.layout.key) as advance:
            result = job.generate(progress=advance, stop=stop, save_state=save)
    except Interrupted:  # Ctrl-C inside a forward (the step was aborted first)
        print(f"kvlayout: interrupted; state saved to {save}; {again}" if save else "kvlayout: interrupted", file=sys.stderr)
        return 130
    if args.json:
        report.print_json(result)
    else:
        report.print_report(result)
    if not result.complete:
        print(f"kvlayout: stopped early; state saved to {save}; {again}", file=sys.stderr)
        return 130
    return 0


def _init_model(args: argparse.Namespace) -> int:
    from kvlayout.models import presets

    path = presets.write_preset(args.dir, args.preset, seed=args.seed)
    print(f"wrote preset {args.preset!r} to {path}/ (config.json, model.safetensors)")
    return 0


def _bench(args: argparse.Namespace) -> int:
    # Imported here so the other commands never pay for loading the suite.
    from kvlayout.bench import suite

    mode = "quick" if args.quick else "full" if args.full else "default"
    rows = [r for r in args.rows.split(",") if r] if args.rows else None
    unknown = [r for r in rows or [] if r not in suite.ROWS]
    if unknown:
        print(f"kvlayout: error: --rows {','.join(unknown)}: expected some of {', '.join(suite.ROWS)}", file=sys.stderr)
        return 2
    suite.run_suite(mode, rows, Path(args.out) if args.out else None)
    return 0


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvlayout", description="KV-cache layouts for MLX, as plugins.")
    sub = parser.add_subparsers(dest="command", required=True)
    plugins = sub.add_parser("plugins", help="list installed layouts and plugins that failed to load")
    plugins.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    plugins.set_defaults(func=_plugins)
    run = sub.add_parser("run", help="generate with a model through the layout the config names")
    run.add_argument("config", nargs="?", help="a TOML run config (default: the embedded one)")
    run.add_argument("--layout", metavar="BACKEND:KIND", help="override the config's layout, e.g. mlx:seq")
    run.add_argument("--json", action="store_true", help="outputs and totals as JSON on stdout")
    run.add_argument(
        "--save-state",
        metavar="DIR",
        help="write the cache and the pending requests to DIR at the end, or on Ctrl-C (after the current step)",
    )
    run.add_argument("--resume", metavar="DIR", help="continue the run --save-state saved in DIR (same config)")
    run.set_defaults(func=_run)
    init = sub.add_parser("init-model", help="write a built-in model in the Hugging Face layout")
    init.add_argument("dir", help="directory to write config.json and model.safetensors into")
    init.add_argument("--preset", default="tiny", help="which built-in model (default: tiny)")
    init.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    init.set_defaults(func=_init_model)
    bench = sub.add_parser(
        "bench", help="kvlayout beside mlx-lm on the same work (needs the bench extra: pip install 'kvlayout[bench]')"
    )
    bench.add_argument("--out", metavar="DIR", help="also write bench.json and bench.png into DIR")
    size = bench.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="a short smoke-test run (small sizes, 2 repeats)")
    size.add_argument("--full", action="store_true", help="the issue's full sizes (much longer)")
    bench.add_argument("--rows", metavar="NAMES", help="comma-separated subset of the rows (default: all)")
    bench.set_defaults(func=_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    try:
        return args.func(args)
    except KVLayoutError as exc:
        # A user's mistake gets one line and exit 2, never a traceback.
        print(f"kvlayout: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
