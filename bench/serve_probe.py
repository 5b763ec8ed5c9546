"""`kvlayout serve` under load, faults, hostile bodies and a long soak, one tree after another, on the tiny preset.

    python bench/serve_probe.py [--tree NAME=PYTHONPATH ...] [--soak N] [--json PATH]

Each tree (`now`, this checkout's core and plugin directories, and any `--tree`: another checkout's, `:`-joined)
runs `python -m kvlayout.cli serve` as a subprocess on a free port of 127.0.0.1 (nothing else is ever
addressed), alone, and is measured on:
- load: 1, 8, 32 and 128 clients (threads), 4 completions each (max_tokens 16): successes, errors by status,
  p50 and p95 latency, wall;
- faults: a client that leaves mid-stream, one that sends half a header then idles, one that sends nothing,
  a body under Content-Type text/plain, a foreign Host header, a non-streamed request abandoned after 0.5 s:
  what it got (a status, the socket closed, or held open past `IDLE_WAIT_S`), whether /health answers within
  1 s after, and the cells used 5 s after (beside those used before: the prefix cache keeps some);
- bad inputs: hostile bodies, the status each gets, and how many got 500;
- soak: `--soak` sequential completions (max_tokens 4), the server's RSS (VmRSS, its process and children)
  at the start, half way and the end.
Every wait is bounded; each server gets SIGTERM at the end, then SIGKILL after 10 s. Standard library only.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import common

ROOT = Path(__file__).resolve().parents[1]
HOST = "127.0.0.1"
TREES = {"now": os.pathsep.join(str(ROOT / p) for p in ("core", "plugins/cell_layout", "plugins/seq_layout"))}
CONFIG = '[model]\npreset = "tiny"\n[cache]\ncapacity = 16384\n[server]\nmax_sequences = 32\n'
MODEL = "tiny"
LOADS = (1, 8, 32, 128)
PER_CLIENT = 4
IDLE_WAIT_S = 15.0  # how long a probe waits for the server to close an idle socket
REQUEST_TIMEOUT_S = 120.0


def rss_kib(pid: int) -> int:
    """VmRSS of `pid` and its children, KiB."""
    pids = [pid]
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    pids.append(int(d.name))
            except (OSError, IndexError, ValueError):
                pass
    total = 0
    for p in pids:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total


class Server:
    def __init__(self, pythonpath: str):
        self.port = common.free_port(HOST)
        self.dir = Path(tempfile.mkdtemp())
        cfg = self.dir / "serve.toml"
        cfg.write_text(CONFIG)
        env = {**os.environ, "PYTHONPATH": pythonpath}
        self.log = open(self.dir / "serve.log", "wb")  # noqa: SIM115 (closed in close())
        self.proc = subprocess.Popen([sys.executable, "-m", "kvlayout.cli", "serve", str(cfg), "--host", HOST,
                                      "--port", str(self.port)], env=env, stdout=self.log, stderr=self.log)
        try:
            common.wait_up(self.proc, lambda: self.health(1.0) is not None, 120, "the server")
        except RuntimeError as e:
            self.log.close()
            raise RuntimeError(f"{e}: {(self.dir / 'serve.log').read_text()[-2000:]}") from None

    def request(self, method: str, path: str, body: bytes | None = None, headers: dict | None = None,
                timeout: float = REQUEST_TIMEOUT_S) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection(HOST, self.port, timeout=timeout)
        try:
            conn.request(method, path, body=body, headers=headers or {})
            r = conn.getresponse()
            return r.status, r.read()
        finally:
            conn.close()

    def complete(self, body: dict, timeout: float = REQUEST_TIMEOUT_S) -> tuple[int, bytes]:
        return self.request("POST", "/v1/completions", json.dumps(body).encode(),
                            {"Content-Type": "application/json"}, timeout)

    def health(self, timeout: float = 1.0) -> dict | None:
        try:
            status, data = self.request("GET", "/health", timeout=timeout)
            return json.loads(data) if status == 200 else None
        except (OSError, ValueError, http.client.HTTPException):
            return None

    def cells_used(self) -> int | None:
        h = self.health(2.0)
        return h["cells"]["used"] if h and "cells" in h else None

    def close(self):
        common.stop(self.proc)
        self.log.close()


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def load(srv: Server, clients: int) -> dict:
    lat, errors, lock = [], {}, threading.Lock()

    def client(i):
        for j in range(PER_CLIENT):
            t0 = time.perf_counter()
            try:
                status, _ = srv.complete({"model": MODEL, "prompt": f"client {i} asks {j}", "max_tokens": 16})
                key = None if status == 200 else str(status)
            except (OSError, http.client.HTTPException) as e:
                key = type(e).__name__
            with lock:
                if key is None:
                    lat.append(time.perf_counter() - t0)
                else:
                    errors[key] = errors.get(key, 0) + 1

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(REQUEST_TIMEOUT_S * PER_CLIENT)
    wall = time.perf_counter() - t0
    return {"ok": len(lat), "errors": errors, "p50_s": round(pct(lat, 0.5) or 0, 3),
            "p95_s": round(pct(lat, 0.95) or 0, 3), "wall_s": round(wall, 2)}


def raw(srv: Server, data: bytes, wait: float) -> str:
    """Send `data` on a fresh socket and wait up to `wait` s: the status line, or that the server closed it, or
    that it held the socket open."""
    s = socket.create_connection((HOST, srv.port), timeout=wait)
    t0 = time.perf_counter()
    try:
        if data:
            s.sendall(data)
        got = b""
        while time.perf_counter() - t0 < wait:
            s.settimeout(max(0.05, wait - (time.perf_counter() - t0)))
            try:
                chunk = s.recv(65536)
            except TimeoutError:
                break
            except ConnectionResetError:
                return f"reset after {time.perf_counter() - t0:.1f} s"
            if not chunk:
                head = got.split(b"\r\n", 1)[0].decode(errors="replace")
                return (head + ", then " if head else "") + f"closed after {time.perf_counter() - t0:.1f} s"
            got += chunk
            if b"\r\n\r\n" in got:
                head = got.split(b"\r\n", 1)[0].decode(errors="replace").replace("HTTP/1.1 ", "")
                return f"{head} after {time.perf_counter() - t0:.1f} s"
        return f"held open past {wait:.0f} s"
    finally:
        s.close()


def leave_mid_stream(srv: Server) -> str:
    body = json.dumps({"model": MODEL, "prompt": "a long story", "max_tokens": 1000, "stream": True}).encode()
    s = socket.create_connection((HOST, srv.port), timeout=10)
    try:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: %s:%d\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % (HOST.encode(), srv.port, len(body)) + body)
        got = b""
        while got.count(b"data:") < 3:
            chunk = s.recv(65536)
            if not chunk:
                return "closed before 3 events"
            got += chunk
        return f"{got.split(b' ', 2)[1].decode()}, left after 3 events"
    except TimeoutError:
        return "no 3 events in 10 s"
    finally:
        s.close()


def abandon(srv: Server) -> str:
    try:
        status, _ = srv.complete({"model": MODEL, "prompt": "a long story", "max_tokens": 1000}, timeout=0.5)
        return f"{status} within 0.5 s"
    except TimeoutError:
        return "left after 0.5 s"


def faults(srv: Server) -> dict:
    hdr = b"POST /v1/completions HTTP/1.1\r\nHost: %s:%d\r\n" % (HOST.encode(), srv.port)
    body = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 4}).encode()
    probes = {
        "leave mid-stream": lambda: leave_mid_stream(srv),
        "half a header, idle": lambda: raw(srv, b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Le",
                                           IDLE_WAIT_S),
        "connect, send nothing": lambda: raw(srv, b"", IDLE_WAIT_S),
        "text/plain body": lambda: raw(srv, hdr + b"Content-Type: text/plain\r\nContent-Length: %d\r\n"
                                       b"Connection: close\r\n\r\n" % len(body) + body, 10),
        "Host rebind.attacker.example": lambda: raw(
            srv, b"POST /v1/completions HTTP/1.1\r\nHost: rebind.attacker.example\r\nContent-Type: application/json"
            b"\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body, 10),
        "abandoned after 0.5 s (max_tokens 1000)": lambda: abandon(srv),
    }
    out = {}
    for name, probe in probes.items():
        before = srv.cells_used()
        what = probe()
        t0 = time.perf_counter()
        healthy = srv.health(1.0) is not None
        health_s = time.perf_counter() - t0
        used = srv.cells_used()
        deadline = time.time() + 5
        while used != before and time.time() < deadline:
            time.sleep(0.25)
            used = srv.cells_used()
        back_s = round(5 - max(0.0, deadline - time.time()), 1)
        out[name] = {"got": what, "health_1s": healthy, "health_s": round(health_s, 3), "cells_before": before,
                     "cells_after_5s": used, "cells_back_s": back_s, "alive": srv.proc.poll() is None}
    return out


def bad_inputs(srv: Server) -> dict:
    ok = {"model": MODEL, "prompt": "hi", "max_tokens": 4}
    chat = {"model": MODEL, "max_tokens": 4}
    bodies = {
        "invalid JSON": b'{"model": "tiny", "prompt": ',
        "empty body": b"",
        "JSON array": b"[1, 2, 3]",
        "temperature NaN": b'{"model": "tiny", "prompt": "hi", "max_tokens": 4, "temperature": NaN}',
        "max_tokens Infinity": b'{"model": "tiny", "prompt": "hi", "max_tokens": Infinity}',
        "n=0": {**ok, "n": 0},
        "max_tokens 10**12": {**ok, "max_tokens": 10**12},
        "max_tokens -1": {**ok, "max_tokens": -1},
        "900 kB message": {**chat, "messages": [{"role": "user", "content": "x" * 900_000}]},
        "unknown fields": {**ok, "frobnicate": True, "logit_bias": {"1": 100}},
        "wrong types": {**ok, "prompt": {"a": 1}, "max_tokens": "16"},
        "token ids out of range": {**ok, "prompt": [-1, 10**9]},
        "control tokens in content": {**chat, "messages": [{"role": "user",
                                                            "content": "<|im_end|><|endoftext|>\u0000\u001b[2J"}]},
        "deep nesting": b'{"model": "tiny", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    }
    out = {}
    for name, body in bodies.items():
        path = "/v1/chat/completions" if isinstance(body, dict) and "messages" in body else "/v1/completions"
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        try:
            status, _ = srv.request("POST", path, data, {"Content-Type": "application/json"}, timeout=30)
            out[name] = status
        except (OSError, http.client.HTTPException) as e:
            out[name] = type(e).__name__
    return out


def soak(srv: Server, n: int) -> dict:
    pid = srv.proc.pid
    rss = {"start_mib": round(rss_kib(pid) / 1024, 1)}
    errors, t0 = 0, time.perf_counter()
    conn = None
    for i in range(n):
        try:
            conn = conn or http.client.HTTPConnection(HOST, srv.port, timeout=30)
            conn.request("POST", "/v1/completions", json.dumps({"model": MODEL, "prompt": f"soak {i}",
                                                                 "max_tokens": 4}),
                         {"Content-Type": "application/json"})
            r = conn.getresponse()
            r.read()
            errors += r.status != 200
        except (OSError, http.client.HTTPException):
            errors += 1
            conn.close()
            conn = None
        if i + 1 == n // 2:
            rss[f"after_{i + 1}_mib"] = round(rss_kib(pid) / 1024, 1)
    if conn:
        conn.close()
    rss[f"after_{n}_mib"] = round(rss_kib(pid) / 1024, 1)
    return {**rss, "errors": errors, "wall_s": round(time.perf_counter() - t0, 1)}


def probe(name: str, pythonpath: str, n_soak: int) -> dict:
    print(f"[{name}] starting", file=sys.stderr, flush=True)
    srv = Server(pythonpath)
    try:
        out = {"load": {}}
        for c in LOADS:
            out["load"][c] = load(srv, c)
            print(f"[{name}] load {c}: {out['load'][c]}", file=sys.stderr, flush=True)
        out["faults"] = faults(srv)
        print(f"[{name}] faults done", file=sys.stderr, flush=True)
        out["bad_inputs"] = bad_inputs(srv)
        out["bad_500s"] = sum(v == 500 for v in out["bad_inputs"].values())
        print(f"[{name}] bad inputs done", file=sys.stderr, flush=True)
        out["soak"] = soak(srv, n_soak)
        out["alive_at_end"] = srv.proc.poll() is None
    finally:
        srv.close()
    return out


def table(results: dict) -> str:
    names = list(results)
    rows = []
    first = results[names[0]]
    for c in first["load"]:
        def cell(r, c=c):
            x = r["load"][c]
            err = ",".join(f"{k}:{v}" for k, v in x["errors"].items()) or "0"
            return f"{x['ok']}/{c * PER_CLIENT} ok, err {err}, p50 {x['p50_s']} p95 {x['p95_s']} wall {x['wall_s']}s"
        rows.append((f"load {c} clients x{PER_CLIENT}", [cell(results[n]) for n in names]))
    for f in first["faults"]:
        def cell(r, f=f):
            x = r["faults"][f]
            return (f"{x['got']}; health {'ok' if x['health_1s'] else 'NO'}; cells {x['cells_before']}->"
                    f"{x['cells_after_5s']} ({x['cells_back_s']} s)")
        rows.append((f"fault: {f}", [cell(results[n]) for n in names]))
    for b in first["bad_inputs"]:
        rows.append((f"bad: {b}", [str(results[n]["bad_inputs"][b]) for n in names]))
    rows.append(("bad: count of 500s", [str(results[n]["bad_500s"]) for n in names]))
    for k in first["soak"]:
        rows.append((f"soak {k}", [str(results[n]["soak"][k]) for n in names]))
    w0 = max(len(r[0]) for r in rows)
    ws = [max(len(n), *(len(r[1][i]) for r in rows)) for i, n in enumerate(names)]
    lines = [" | ".join([" " * w0, *(n.ljust(w) for n, w in zip(names, ws))])]
    lines.append("-+-".join(["-" * w0, *("-" * w for w in ws)]))
    lines += [" | ".join([r[0].ljust(w0), *(v.ljust(w) for v, w in zip(r[1], ws))]) for r in rows]
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tree", action="append", default=[], help="NAME=PYTHONPATH (repeatable)")
    ap.add_argument("--soak", type=int, default=2000, help="sequential completions in the soak (default 2000)")
    ap.add_argument("--json", help="write the figures here")
    a = ap.parse_args()
    trees = {}
    for t in a.tree:
        name, _, path = t.partition("=")
        trees[name] = path
    trees.update({k: v for k, v in TREES.items() if k not in trees})
    results = {name: probe(name, path, a.soak) for name, path in trees.items()}
    print(table(results))
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
