"""Tensor-parallel runs over `mx.distributed`: two ranks on the loopback give the single process's tokens.

Runs are started by `mlx.launch --backend ring` on 127.0.0.1, as a user starts them. Where a
test needs each rank's own exit status (mlx.launch reports them only as warnings and exits 0
whatever they were), it starts the ranks as mlx.launch's ring backend does on one host: each
process with MLX_RANK and an MLX_HOSTFILE listing one 127.0.0.1 port per rank.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest
from mlx.utils import tree_flatten

from kvlayout.models import smollm2
from kvlayout.models.presets import build_preset, write_preset
from tests.helpers import cli_env, kvlayout

LAUNCH = shutil.which("mlx.launch")
KVLAYOUT = shutil.which("kvlayout")
BOUND_S = 120  # no launch here takes more; past it the test fails instead of hanging
STARTED: list[subprocess.Popen] = []  # every launch's and rank's process, each the leader of its own group

REQUESTS = "".join(
    f'[[requests]]\nprompt = "{p}"\nmax_tokens = {m}\nn = {n}\n'
    for p, m, n in (("The cells of a cache, shared by forks", 14, 2), ("a second prompt", 10, 1),
                    ("and a third, longer than the others by a few words", 12, 2))
)


CHUNKS = "[engine]\nprefill_chunk = 64\n"  # the prompts span several steps (preemption falls among them)


def run_toml(tmp_path: Path, layout: str = "cell", capacity: int = 512, extra: str = "") -> Path:
    path = tmp_path / f"run-{layout}-{capacity}.toml"
    path.write_text(f'[layout]\nbackend = "mlx"\nkind = "{layout}"\n'
                    f'[cache]\ncapacity = {capacity}\nkv_dtype = "float32"\n'
                    f'[model]\npreset = "tiny"\n[sampling]\ntemperature = 0.0\n{extra or CHUNKS}{REQUESTS}')
    return path


@pytest.fixture(autouse=True)
def no_process_left_behind():
    """Each test's launches and ranks, and whatever they started, are killed when it ends, passed or failed:
    a rank left waiting would outlive pytest."""
    yield
    while STARTED:
        proc = STARTED.pop()
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # its own group: mlx.launch's ranks die with it
            proc.communicate()


def started(cmd: list[str], env: dict) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    STARTED.append(proc)
    return proc


def launched(n: int, *argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """`mlx.launch --backend ring -n N kvlayout ARGV` on this machine, this tree's code."""
    assert LAUNCH and KVLAYOUT, "mlx.launch and kvlayout are installed with the package"
    cmd = [LAUNCH, "--backend", "ring", "-n", str(n), KVLAYOUT, *argv]
    proc = started(cmd, env or cli_env())
    out, err = proc.communicate(timeout=BOUND_S)  # past it, the fixture kills the launch and its ranks
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ranks(n: int, tmp_path: Path, *argv: str, env: dict | None = None,
          only: list[int] | None = None) -> list[subprocess.Popen]:
    """N `kvlayout ARGV` processes joined over the ring backend on 127.0.0.1, as mlx.launch starts them
    (`only`: start those ranks alone; the hostfile still lists N)."""
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps([[f"127.0.0.1:{free_port()}"] for _ in range(n)]))
    return [
        started([sys.executable, "-m", "kvlayout.cli", *argv],
                {**(env or cli_env()), "MLX_RANK": str(r), "MLX_HOSTFILE": str(hosts)})
        for r in (range(n) if only is None else only)
    ]


def token_ids(out: dict) -> list[list[list[int]]]:
    return [[s["token_ids"] for s in r["samples"]] for r in out["requests"]]


def one_process(*argv: str) -> dict:
    done = kvlayout(*argv, "--json")
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


# cell at 80 cells: forks and preemption; seq: one sample at a time (the roomy cell case adds nothing).
@pytest.mark.parametrize("layout,capacity", [("cell", 80), ("seq", 512)])
def test_two_ranks_give_the_single_process_tokens_holding_half_the_kv(tmp_path, layout, capacity):
    config = run_toml(tmp_path, layout, capacity)
    alone = one_process("run", str(config))
    # Every step, every rank's table checksum is compared with rank 0's (a difference ends the run).
    done = launched(2, "run", str(config), "--json", env=cli_env(KVLAYOUT_CHECK_RANKS="1"))
    assert "exited with code" not in done.stderr, done.stderr  # mlx.launch warns of a rank that failed
    both = json.loads(done.stdout)  # rank 0's alone: the others print nothing
    assert token_ids(both) == token_ids(alone)
    assert all(len(ids) > 0 for r in token_ids(alone) for ids in r)
    if capacity == 80:  # forks and preemption, decided alike on both ranks
        assert alone["stats"]["preemptions"] > 0 and both["stats"]["preemptions"] == alone["stats"]["preemptions"]
    if layout == "cell":
        assert alone["stats"]["peak_cells"] < alone["stats"]["peak_tokens"]  # the forks share cells
    assert both["world_size"] == 2 and [r["rank"] for r in both["ranks"]] == [0, 1]
    # The tiny preset: 2 KV heads of 16, 2 layers, float32: 512 B a cell alone, a head each per rank.
    assert alone["kv_bytes"]["per_cell"] == 512
    assert [r["kv_bytes_per_cell"] for r in both["ranks"]] == [256, 256]
    assert both["kv_bytes"]["per_cell"] == 256
    assert "ranks" not in alone and "world_size" not in alone
    # Each rank holds half of every attention and MLP projection, the embeddings, norms and head whole.
    model, _, _ = build_preset("tiny")
    params = tree_flatten(model.parameters())
    split = sum(p.nbytes for name, p in params if ".self_attn." in name or ".mlp." in name)
    whole = sum(p.nbytes for _, p in params)
    assert [r["model_bytes"] for r in both["ranks"]] == [whole - split // 2] * 2


@pytest.mark.parametrize("layout,capacity", [("cell", 80), ("seq", 512)])
def test_two_ranks_speculating_give_the_single_process_tokens_without_speculation(tmp_path, layout, capacity):
    """Every rank drafts the same (untimed pacing), verifies, and keeps rank 0's tokens (the agree
    collective): the tables stay alike step by step and the tokens are speculation off's."""
    alone = one_process("run", str(run_toml(tmp_path, layout, capacity)))
    config = run_toml(tmp_path, layout, capacity, CHUNKS + 'speculate = "ngram"\n')
    done = launched(2, "run", str(config), "--json", env=cli_env(KVLAYOUT_CHECK_RANKS="1"))
    assert "exited with code" not in done.stderr, done.stderr
    both = json.loads(done.stdout)
    assert token_ids(both) == token_ids(alone)
    assert both["stats"]["drafted_tokens"] > 0


def test_a_model_whose_kv_heads_do_not_divide_is_refused_in_one_line(tmp_path):
    # SmolLM2-135M has 3 KV heads: not two ranks' worth.
    model = smollm2.smollm2_dir()
    procs = ranks(2, tmp_path, "run", "--model", str(model), "--prompt", "hi", "--max-tokens", "2")
    outs = [p.communicate(timeout=BOUND_S) for p in procs]
    assert [p.returncode for p in procs] == [2, 2]
    for out, err in outs:
        assert out == ""
        lines = err.strip().splitlines()
        assert len(lines) == 1 and "num_key_value_heads=3 does not divide among 2 ranks; run it on 3 ranks" in lines[0]


def test_smollm2_on_three_ranks_says_what_it_says_alone(tmp_path):
    model = smollm2.smollm2_dir()
    argv = ("run", "--model", str(model), "--prompt", "What is the capital of France?", "--max-tokens", "4")
    alone = one_process(*argv)
    done = launched(3, *argv, "--json")
    assert "exited with code" not in done.stderr, done.stderr
    three = json.loads(done.stdout)
    assert token_ids(three) == token_ids(alone)
    assert three["requests"][0]["samples"][0]["text"].startswith("The capital of France")
    assert [r["kv_bytes_per_cell"] for r in three["ranks"]] == [alone["kv_bytes"]["per_cell"] // 3] * 3


def test_a_killed_rank_ends_the_other_with_an_error_naming_it_within_a_bound(tmp_path):
    long = "".join(f'[[requests]]\nprompt = "request {i} of a long run"\nmax_tokens = 1000\n' for i in range(64))
    config = tmp_path / "long.toml"
    config.write_text('[layout]\nbackend = "mlx"\nkind = "cell"\n[cache]\ncapacity = 65536\nmax_seqs = 64\n'
                      f'kv_dtype = "float32"\n[model]\npreset = "tiny"\n[sampling]\ntemperature = 1.0\n{long}')
    procs = ranks(2, tmp_path, "run", str(config), "--json", env=cli_env(KVLAYOUT_COLLECTIVE_TIMEOUT_S="5"))
    time.sleep(4)
    assert procs[0].poll() is None, "the run ended before a rank could be killed"
    procs[1].kill()
    t0 = time.monotonic()
    out, err = procs[0].communicate(timeout=60)
    took = time.monotonic() - t0
    procs[1].communicate()
    assert procs[0].returncode != 0 and took < 5 + 10
    assert "kvlayout: error: rank 0 of 2:" in err and out == ""


# (command, ranks listed, ranks started): rank 0 alone, another rank alone, and two of three.
@pytest.mark.parametrize("command,n,present", [("run", 2, [0]), ("run", 2, [1]), ("run", 3, [0, 1]), ("serve", 2, [0])])
def test_a_rank_whose_peers_never_join_names_them_within_the_timeout(tmp_path, command, n, present):
    config = tmp_path / "serve.toml"
    config.write_text('[model]\npreset = "tiny"\n')
    argv = ("run", str(run_toml(tmp_path)), "--json") if command == "run" else (
        "serve", str(config), "--port", str(free_port()))
    procs = ranks(n, tmp_path, *argv, env=cli_env(KVLAYOUT_COLLECTIVE_TIMEOUT_S="3"), only=present)
    t0 = time.monotonic()
    outs = [p.communicate(timeout=60) for p in procs]
    took = time.monotonic() - t0
    assert [p.returncode for p in procs] == [2] * len(present) and took < 3 + 20, outs
    hosts = [h[0] for h in json.loads((tmp_path / "hosts.json").read_text())]
    absent = [r for r in range(n) if r not in present]
    for rank, (out, err) in zip(present, outs):
        assert out == ""
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"kvlayout: error: rank {rank} of {n}: "), err
        assert all(f"rank {r} ({hosts[r]}) did not " in lines[0] for r in absent), err
        assert "KVLAYOUT_COLLECTIVE_TIMEOUT_S" in lines[0]


def test_a_prompt_for_a_model_without_a_chat_template_runs_on_two_ranks(tmp_path):
    # --prompt sends plain text to such a model (the config's plain_chat, no TOML key): every rank must.
    model = write_preset(tmp_path / "tiny", "tiny")
    argv = ("run", "--model", str(model), "--prompt", "hello there", "--max-tokens", "6")
    done = launched(2, *argv, "--json")
    assert "exited with code" not in done.stderr, done.stderr
    assert token_ids(json.loads(done.stdout)) == token_ids(one_process(*argv))


def test_a_config_rank_0_refuses_stops_every_rank_said_once(tmp_path):
    procs = ranks(2, tmp_path, "run", str(tmp_path / "missing.toml"))
    outs = [p.communicate(timeout=BOUND_S) for p in procs]
    assert [p.returncode for p in procs] == [2, 2]
    said = [line for _, err in outs for line in err.strip().splitlines()]
    assert said == [f"kvlayout: error: config file '{tmp_path / 'missing.toml'}' does not exist; pass a TOML file or "
                    "no argument for the default"]


def test_each_rank_saves_its_shard_and_a_resume_needs_as_many_ranks(tmp_path):
    config, state = run_toml(tmp_path), tmp_path / "state"
    done = launched(2, "run", str(config), "--json", "--save-state", str(state))
    assert "exited with code" not in done.stderr, done.stderr
    assert sorted(p.name for p in state.iterdir()) == ["rank-0-of-2", "rank-1-of-2"]
    alone = one_process("run", str(config))
    again = launched(2, "run", str(config), "--json", "--resume", str(state))
    assert "exited with code" not in again.stderr, again.stderr
    assert token_ids(json.loads(again.stdout)) == token_ids(alone)
    refused = kvlayout("run", str(config), "--resume", str(state))
    assert refused.returncode == 2
    assert refused.stderr.strip() == (f"kvlayout: error: --resume {state}: saved by a run of 2 ranks; this run has one "
                                      "process (resume it with mlx.launch -n 2)")
    single = tmp_path / "single"
    assert kvlayout("run", str(config), "--json", "--save-state", str(single)).returncode == 0
    procs = ranks(2, tmp_path, "run", str(config), "--resume", str(single))
    errs = [p.communicate(timeout=BOUND_S)[1] for p in procs]
    assert [p.returncode for p in procs] == [2, 2]
    assert f"--resume {single}: saved by a run in one process; this run has 2 ranks" in errs[0]


def test_serve_on_two_ranks_answers_as_one_process_and_stops_on_ctrl_c(tmp_path):
    config = tmp_path / "serve.toml"
    config.write_text('[model]\npreset = "tiny"\n[cache]\ncapacity = 2048\nkv_dtype = "float32"\n')
    prompts = ["hello there", "a second prompt", "third"]
    run = tmp_path / "run.toml"
    run.write_text('[model]\npreset = "tiny"\n[cache]\ncapacity = 2048\nkv_dtype = "float32"\n[sampling]\n'
                   'temperature = 0.0\n' + "".join(f'[[requests]]\nprompt = "{p}"\nmax_tokens = 8\n' for p in prompts))
    want = [r["samples"][0]["text"] for r in one_process("run", str(run))["requests"]]
    port = free_port()
    procs = ranks(2, tmp_path, "serve", str(config), "--port", str(port))
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "no server came up"
                time.sleep(0.2)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=60)
        import concurrent.futures

        def ask(prompt: str) -> str:
            return client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0).choices[0].text

        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            assert list(pool.map(ask, prompts)) == want
    finally:
        for p in procs:  # Ctrl-C reaches every rank of a launch
            p.send_signal(signal.SIGINT)
        outs = [p.communicate(timeout=60) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert "tensor-parallel over 2 ranks" in outs[0][1]


def test_a_launch_whose_hostfile_is_no_host_list_is_refused_in_one_line(tmp_path):
    hosts = tmp_path / "hosts.json"
    hosts.write_text("")
    done = kvlayout("run", str(run_toml(tmp_path)), env=cli_env(MLX_RANK="0", MLX_HOSTFILE=str(hosts)))
    assert done.returncode == 2 and done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"kvlayout: error: cannot join the other ranks (MLX_RANK=0, "
                                                   f"MLX_HOSTFILE={hosts}): ")


# Families whose projections split (Phi-3's fused qkv_proj / gate_up_proj do not: refused below), by structure:
# a dense block quantized in mixed bits (Qwen3), and (gpt-oss)
# experts split in place with their block summing over the ranks, sinks split by head, sliding layers.
@pytest.mark.parametrize("name", ["qwen3_q4_mixed", "gpt_oss"])
def test_two_ranks_of_each_family_give_the_single_process_tokens(tmp_path, name):
    from tests.models.families import ALL, write_checkpoint

    model_dir = write_checkpoint(tmp_path / name, ALL[name])
    prompts = [[(7 * i + j) % 256 for j in range(n)] for i, n in enumerate((21, 9, 14))]  # past the windows
    config = tmp_path / "run.toml"
    config.write_text(
        f'[layout]\nbackend = "mlx"\nkind = "cell"\n[cache]\ncapacity = 256\nkv_dtype = "float32"\n'
        f'[model]\npath = "{model_dir}"\ndequantize = false\n[sampling]\ntemperature = 0.0\n'
        f'[engine]\nprefill_chunk = 8\n'
        + "".join(f"[[requests]]\nprompt_ids = {p}\nmax_tokens = 6\n" for p in prompts)
    )
    alone = one_process("run", str(config))
    done = launched(2, "run", str(config), "--json", env=cli_env(KVLAYOUT_CHECK_RANKS="1"))
    assert "exited with code" not in done.stderr, done.stderr
    both = json.loads(done.stdout)
    assert token_ids(both) == token_ids(alone)
    assert all(len(ids) == 6 for r in token_ids(alone) for ids in r)
    assert [r["kv_bytes_per_cell"] for r in both["ranks"]] == [alone["kv_bytes"]["per_cell"] // 2] * 2


def test_a_model_with_fused_projections_is_refused_on_two_ranks_in_one_line(tmp_path):
    from tests.models.families import ALL, write_checkpoint

    model_dir = write_checkpoint(tmp_path / "phi3", ALL["phi3"])
    procs = ranks(2, tmp_path, "run", "--model", str(model_dir), "--prompt", "hi", "--max-tokens", "2")
    outs = [p.communicate(timeout=BOUND_S) for p in procs]
    assert [p.returncode for p in procs] == [2, 2]
    for out, err in outs:
        lines = err.strip().splitlines()
        assert out == "" and len(lines) == 1
        assert "layer 0 has a fused qkv_proj, which kvlayout does not split over ranks" in lines[0]


def test_a_rank_that_answers_the_roll_call_and_never_joins_the_ring_is_named_within_the_timeout(tmp_path):
    # Rank 1 (this test) reports to rank 0's roll call, hears "go", then never joins the ring: the ring's
    # join would hold rank 0 in accept() for good (a rank dying right after the roll call does this).
    import socket

    procs = ranks(2, tmp_path, "run", str(run_toml(tmp_path)), "--json",
                  env=cli_env(KVLAYOUT_COLLECTIVE_TIMEOUT_S="3"), only=[0])
    host, _, port = json.loads((tmp_path / "hosts.json").read_text())[0][0].partition(":")
    deadline = time.monotonic() + 60
    while True:  # rank 0 listens once it has started
        try:
            conn = socket.create_connection((host, int(port)), timeout=1)
            break
        except OSError:
            assert time.monotonic() < deadline and procs[0].poll() is None, procs[0].communicate()
            time.sleep(0.1)
    with conn:
        conn.sendall(b"kvlayout-join 1 2\n")
        conn.settimeout(30)
        assert conn.recv(64).startswith(b"go")
    t0 = time.monotonic()
    out, err = procs[0].communicate(timeout=60)
    took = time.monotonic() - t0
    lines = err.strip().splitlines()
    assert procs[0].returncode != 0 and took < 3 + 10 and out == "", err
    assert len(lines) == 1 and lines[0].startswith(
        "kvlayout: error: rank 0 of 2: the ranks' ring did not form within 3 s"), err
    assert "KVLAYOUT_COLLECTIVE_TIMEOUT_S" in lines[0]


def test_a_join_watch_that_cannot_start_is_one_error_naming_the_rank(monkeypatch):
    # No process to spare for the watcher: the run ends with one DistributedError naming the rank (the CLI's
    # one line), before any join that nothing would bound.
    import subprocess

    from kvlayout.distributed.rollcall import JoinWatch, Ring
    from kvlayout.errors import DistributedError

    def no_fork(*args, **kwargs):
        raise OSError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(subprocess, "Popen", no_fork)
    with pytest.raises(DistributedError, match=r"^rank 1 of 2: cannot start the watch over the ring's join \("):
        with JoinWatch(Ring(1, ("127.0.0.1:1", "127.0.0.1:2")), 3.0, "KVLAYOUT_COLLECTIVE_TIMEOUT_S"):
            raise AssertionError("the join ran unwatched")
