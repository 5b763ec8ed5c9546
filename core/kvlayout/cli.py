"""The `kvlayout` command."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Callable

from rich.console import Console
from rich.table import Table

from kvlayout import registry
from kvlayout.errors import KVLayoutError

# Each subcommand adds its own parser; later ones (run, init-model, bench) join here.
Command = Callable[[argparse.Namespace], int]


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
    from kvlayout.runner import config, engine, report

    cfg = config.load_config(args.config)
    if args.layout:
        cfg = cfg.with_layout(args.layout)
    job = engine.prepare(cfg)  # every user error surfaces here, before the progress bar
    with report.progress_bar(job.planned_tokens, cfg.layout.key) as advance:
        result = job.generate(progress=advance)
    if args.json:
        report.print_json(result)
    else:
        report.print_report(result)
    return 0


def _init_model(args: argparse.Namespace) -> int:
    from kvlayout.runner import presets

    path = presets.write_preset(args.dir, args.preset, seed=args.seed)
    print(f"wrote preset {args.preset!r} to {path}/ (config.json, model.safetensors)")
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
    run.set_defaults(func=_run)
    init = sub.add_parser("init-model", help="write a built-in model in the Hugging Face layout")
    init.add_argument("dir", help="directory to write config.json and model.safetensors into")
    init.add_argument("--preset", default="tiny", help="which built-in model (default: tiny)")
    init.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    init.set_defaults(func=_init_model)
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
