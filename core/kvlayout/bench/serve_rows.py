"""Row 10 (serve): K concurrent chat clients against `kvlayout serve` and `mlx_lm.server`, one model directory.

Both servers run as their own processes on 127.0.0.1 (free ports), started
once and stopped at the end of the row, and are measured one after the other
at each K (kvlayout first at odd K positions, mlx-lm first at even ones, so
drift hits both alike). Each of the K clients (the official `openai` client,
one thread each) sends `serve_requests` streamed chat requests, one after
another: a shared system prompt of `serve_system` tokens, then a question of
its own, greedy, `serve_tokens` at most. Every K uses a system prompt of
its own, so each phase starts with nothing of it cached on either server
and what is reused is what the phase's own clients shared.

Measured per phase: wall time (first request sent to last answer read),
requests/s, generated tok/s (each server's own usage count: mlx_lm.server
counts the EOS that ends an answer, kvlayout does not, so with identical
answers the wall-time ratio is the fairer throughput ratio), time to first
token (request sent to its first content chunk) p50 and p99, and the prompt
tokens each server reports as cached. The answers of both servers are
compared text for text.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from kvlayout.bench import peers
from kvlayout.bench.record import Row
from kvlayout.errors import ConfigError

START_BOUND_S = 300  # a server that is not answering by then is a failed row
READY = re.compile(r"serving \S+ on (http://\S+)")
RULES = [
    "Answer the user's question in one short sentence.",
    "Prefer plain words to jargon, and never invent facts you are unsure of.",
    "When a question is ambiguous, answer the most likely reading and say so briefly.",
    "Numbers are written as digits; units follow the International System.",
    "Do not repeat the question; do not apologise; do not add a greeting.",
    "If the question asks for a list, give at most three items separated by commas.",
    "Names of people, places and works are spelled as their own languages spell them.",
    "Keep the tone friendly and calm, as a patient teacher would speak to a curious student.",
]
QUESTIONS = [
    "What is the capital of France?", "Why is the sky blue?", "Name a prime number above ten.",
    "What does a cache store?", "How many legs does a spider have?", "What is the boiling point of water?",
    "Who wrote Hamlet?", "What gas do plants take in?", "How far is the Moon?", "What is 7 times 8?",
    "Which ocean is the largest?", "What is the speed of light?", "What language is spoken in Brazil?",
    "What is the freezing point of water?", "What is the largest planet?", "Who painted the Mona Lisa?",
]


def system_prompt(tokenizer, tokens: int, phase: int) -> str:
    """A system prompt of about `tokens` tokens under `tokenizer`, its first words naming `phase`
    (so no phase finds another's prompt cached)."""
    text = f"Session {phase}. You are a helpful assistant for a help desk."
    rules = iter(RULES * 1000)
    while len(tokenizer.encode(text)) < tokens:
        text += " " + next(rules)
    return text


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Process:
    """A server process, its stderr collected; stopped (SIGTERM, then kill) by `stop`."""

    def __init__(self, name: str, argv: list[str]):
        self.name = name
        self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True, env={**os.environ, "COLUMNS": "200"})
        self.lines: list[str] = []
        self.reader = threading.Thread(target=self.collect, daemon=True)
        self.reader.start()

    def collect(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))

    def failed(self) -> str | None:
        if self.proc.poll() is None:
            return None
        return f"{self.name} exited ({self.proc.returncode}): " + " | ".join(self.lines[-5:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def wait_until(ready, process: Process) -> None:
    deadline = time.monotonic() + START_BOUND_S
    while time.monotonic() < deadline:
        why = process.failed()
        if why:
            raise ConfigError(f"kvlayout bench serve: {why}")
        if ready():
            return
        time.sleep(0.2)
    raise ConfigError(f"kvlayout bench serve: {process.name} did not answer within {START_BOUND_S} s")


def start_kvlayout(model_dir: Path, capacity: int, tmp: Path) -> tuple[Process, str]:
    config = tmp / "serve.toml"
    config.write_text(
        f'[model]\npath = "{model_dir}"\n[cache]\ncapacity = {capacity}\nmax_seqs = 64\n'
        "[server]\nmax_sequences = 32\nqueue = 256\n[engine]\nprefill_chunk = 512\n"
    )
    p = Process("kvlayout serve", [sys.executable, "-m", "kvlayout.cli", "serve", str(config), "--port", "0"])
    url: list[str] = []

    def ready() -> bool:
        for line in p.lines:
            if m := READY.search(line):
                url.append(m.group(1))
                return True
        return False

    wait_until(ready, p)
    return p, url[0]


def start_mlx_lm(model_dir: Path) -> tuple[Process, str]:
    port = free_port()
    p = Process("mlx_lm.server", [sys.executable, "-m", "mlx_lm", "server", "--model", str(model_dir),
                                  "--host", "127.0.0.1", "--port", str(port), "--log-level", "WARNING"])
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        try:
            with urllib.request.urlopen(f"{url}/v1/models", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    wait_until(ready, p)
    return p, url


def one_request(client, model: str, system: str, question: str, tokens: int) -> dict:
    """One streamed chat request: its time to first token, text, and the server's usage."""
    t0 = time.perf_counter()
    ttft, parts, usage = None, [], None
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "system", "content": system}, {"role": "user", "content": question}],
        max_tokens=tokens, temperature=0, stream=True, stream_options={"include_usage": True},
    )
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                if ttft is None:
                    ttft = time.perf_counter() - t0
                parts.append(choice.delta.content)
    details = getattr(usage, "prompt_tokens_details", None)
    return {
        "ttft": ttft if ttft is not None else time.perf_counter() - t0,
        "text": "".join(parts),
        "completion_tokens": usage.completion_tokens if usage else 0,
        "prompt_tokens": usage.prompt_tokens if usage else 0,
        "cached_tokens": (getattr(details, "cached_tokens", 0) or 0) if details is not None else 0,
    }


def phase(url: str, model: str, system: str, k: int, per_client: int, tokens: int) -> dict:
    """K clients, each sending `per_client` requests one after another: wall time and every answer."""
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=1800)

    def one_client(c: int) -> list[dict]:
        return [one_request(client, model, system, QUESTIONS[(c * per_client + j) % len(QUESTIONS)] + f" ({c}.{j})",
                            tokens) for j in range(per_client)]

    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(k) as pool:
        answers = [a for got in pool.map(one_client, range(k)) for a in got]
    return {"wall": time.perf_counter() - t0, "answers": answers}


def summary(p: dict) -> dict:
    a = p["answers"]
    ttfts = sorted(x["ttft"] for x in a)
    return {
        "wall_s": p["wall"],
        "requests_s": len(a) / p["wall"],
        "gen_tok_s": sum(x["completion_tokens"] for x in a) / p["wall"],
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_p99_s": ttfts[min(len(ttfts) - 1, round(0.99 * (len(ttfts) - 1)))],
        "generated": sum(x["completion_tokens"] for x in a),
        "prompt_tokens": sum(x["prompt_tokens"] for x in a),
        "cached_tokens": sum(x["cached_tokens"] for x in a),
    }


def serve_model(ctx: dict) -> Path:
    """--model DIR, else SmolLM2-135M-Instruct (fetched and converted once, cached)."""
    if ctx.get("user_model") is not None:
        return Path(ctx["user_model"]).resolve()
    from kvlayout.models import smollm2

    return smollm2.smollm2_dir(progress=lambda line: print(line, file=sys.stderr))


def row_serve(z: dict, ctx: dict) -> tuple[str, list[Row]]:
    peers.require("openai", "kvlayout bench serve (its clients)", package="openai")
    model_dir = serve_model(ctx)
    if not (model_dir / "tokenizer.json").is_file():  # both servers chat through it; the bench counts with it
        raise ConfigError(f"--model {model_dir}: kvlayout bench serve needs a model directory with a tokenizer.json "
                          "(a chat model's, e.g. `kvlayout init-model DIR --preset smollm2`)")
    tokenizer = peers.mlx_lm("utils").load_tokenizer(model_dir)
    ks, per_client, tokens, sys_tokens = z["serve_clients"], z["serve_requests"], z["serve_tokens"], z["serve_system"]
    capacity = 16384
    out: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="kvlayout-bench-serve-") as tmp:
        ours = theirs = None
        try:
            ours, ours_url = start_kvlayout(model_dir, capacity, Path(tmp))
            theirs, theirs_url = start_mlx_lm(model_dir)
            sides = {"kvlayout serve": (ours_url, model_dir.name), "mlx_lm.server": (theirs_url, "default_model")}
            for url, model in sides.values():  # warm both: MLX's first forwards compile and allocate
                phase(url, model, "Warm up.", 1, 1, 4)
            for i, k in enumerate(ks):
                system = system_prompt(tokenizer, sys_tokens, k)
                got = {}
                order = list(sides) if i % 2 == 0 else list(sides)[::-1]
                for name in order:
                    url, model = sides[name]
                    print(f"[serve: K={k} on {name}]", file=sys.stderr)
                    got[name] = phase(url, model, system, k, per_client, tokens)
                out += rows_of(k, got)
        finally:
            for p in (ours, theirs):
                if p is not None:
                    p.stop()
    work = (f"{model_dir}: K concurrent clients (K = {', '.join(map(str, ks))}), each sending {per_client} streamed "
            f"chat request(s) one after another: a {sys_tokens}-token system prompt shared by the phase (its own "
            f"per K) and a question of its own, greedy, at most {tokens} tokens; both servers warmed, run one after "
            "the other per K. kvlayout serve: mlx:cell, prefill_chunk 512, prefix cache on; mlx_lm.server: its "
            "defaults (batched, its LRU prompt cache). A/B: wall time for the same requests, and per-request "
            "time to first token. Gen tok/s are each server's usage counts (mlx_lm.server's include the EOS "
            "that ends an answer).")
    return work, out


def rows_of(k: int, got: dict) -> list[Row]:
    a, b = (summary(got[n]) for n in ("kvlayout serve", "mlx_lm.server"))
    same = sum(
        x["text"] == y["text"] for x, y in zip(got["kvlayout serve"]["answers"], got["mlx_lm.server"]["answers"])
    )
    n = len(got["kvlayout serve"]["answers"])
    wall = Row(
        "10 serve", f"K={k}: wall, {n} requests", "kvlayout serve", "mlx_lm.server", [a["wall_s"]], [b["wall_s"]],
        f"{a['gen_tok_s']:.1f} vs {b['gen_tok_s']:.1f} gen tok/s ({a['gen_tok_s'] / b['gen_tok_s']:.2f}x); "
        f"{a['requests_s']:.2f} vs {b['requests_s']:.2f} req/s; cached prompt tokens {a['cached_tokens']} of "
        f"{a['prompt_tokens']} vs {b['cached_tokens']} of {b['prompt_tokens']}; answers identical {same}/{n}",
        {"kvlayout": a, "mlx_lm": b, "identical": same, "requests": n},
    )
    ttft = Row(
        "10 serve", f"K={k}: time to first token", "kvlayout serve", "mlx_lm.server",
        [x["ttft"] for x in got["kvlayout serve"]["answers"]], [x["ttft"] for x in got["mlx_lm.server"]["answers"]],
        f"p50 {a['ttft_p50_s']:.2f} vs {b['ttft_p50_s']:.2f} s ({a['ttft_p50_s'] / b['ttft_p50_s']:.2f}x); "
        f"p99 {a['ttft_p99_s']:.2f} vs {b['ttft_p99_s']:.2f} s",
    )
    return [wall, ttft]
