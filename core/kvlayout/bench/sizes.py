"""How big each mode's work is; every row reads its sizes from one of these dicts.

The default run is scaled to finish in minutes on a 2-core CPU (each row's
workload line says where it is smaller than the issue's sizes); "full" is the
issue's sizes, "quick" a smoke test of seconds. `model_repeats` is the repeats of
the rows on a model the user has (8, 9, 13), whose every call runs that model:
one in "quick", with few tokens and short prompts, so it stays a smoke test on a real model too.
"""

from __future__ import annotations

SIZES = {
    "quick": dict(
        repeats=2, write_ctx=(1024, 8192), write_reps=5, grow=1024, grow_reps=1, gen_tokens=32,
        batch_ns=(8,), batch_max_prompt=256, batch_tokens=8, prefix_prompt=256, prefix_ns=(1, 4),
        model_tokens=8, model_repeats=1, chat_n=4, chat_tokens=4, lockstep=((4, 32),), lockstep_tokens=4,
        book_sizes=(4096,), book_dense_max=4096, group_seqs=8, group_len=256, attn_heads=(8, 2, 64),
        serve_clients=(1, 4), serve_requests=1, serve_tokens=8, serve_system=128,
        kvq_ns=(1, 8), kvq_tokens=4, kvq_single_tokens=8, kvq_server_n=4, kvq_forced=2, kvq_repeats=1,
        shape_seqs=(8,), shape_prompt=32, shape_steps=64,
        host_tokens=32, host_layers=8, host_repeats=2, host_seqs=(8,), host_batch_tokens=8,
    ),
    "default": dict(
        repeats=3, write_ctx=(1024, 8192, 32768), write_reps=20, grow=8192, grow_reps=2, gen_tokens=256,
        batch_ns=(8, 32), batch_max_prompt=1024, batch_tokens=32, prefix_prompt=1024, prefix_ns=(1, 4, 16),
        model_tokens=32, model_repeats=3, chat_n=32, chat_tokens=24, lockstep=((8, 256), (32, 64)), lockstep_tokens=16,
        book_sizes=(4096, 32768), book_dense_max=4096, group_seqs=32, group_len=1024, attn_heads=(32, 8, 128),
        serve_clients=(1, 4, 16), serve_requests=2, serve_tokens=16, serve_system=512,
        kvq_ns=(1, 8, 32), kvq_tokens=16, kvq_single_tokens=32, kvq_server_n=16, kvq_forced=8, kvq_repeats=2,
        shape_seqs=(8, 32), shape_prompt=64, shape_steps=256,
        host_tokens=200, host_layers=8, host_repeats=5, host_seqs=(8, 32), host_batch_tokens=64,
    ),
    "full": dict(
        repeats=5, write_ctx=(1024, 8192, 32768), write_reps=50, grow=32768, grow_reps=2, gen_tokens=256,
        batch_ns=(8, 32), batch_max_prompt=1024, batch_tokens=128, prefix_prompt=1024, prefix_ns=(1, 4, 16),
        model_tokens=128, model_repeats=5, chat_n=32, chat_tokens=64, lockstep=((8, 256), (32, 256)),
        lockstep_tokens=32,
        book_sizes=(4096, 32768, 131072), book_dense_max=32768, group_seqs=32, group_len=1024,
        attn_heads=(32, 8, 128), serve_clients=(1, 4, 16), serve_requests=4, serve_tokens=64, serve_system=512,
        kvq_ns=(1, 8, 32), kvq_tokens=64, kvq_single_tokens=128, kvq_server_n=16, kvq_forced=32, kvq_repeats=3,
        shape_seqs=(8, 32), shape_prompt=256, shape_steps=256,
        host_tokens=400, host_layers=16, host_repeats=7, host_seqs=(8, 32), host_batch_tokens=128,
    ),
}

H_KV, D = 8, 128  # rows 1 and 5: the K/V shape (heads, head dim)
