"""`kvlayout bench`: kvlayout beside mlx-lm on the same work, one table.

Every comparison runs both sides in this one process (row 10: two server
processes, driven from this one), interleaved (one
repeat of each side per round, the order rotating each round), several
repeats; the table gives min and median seconds per side and the ratio of the
medians, A / B in time (below 1: A is faster). Each row states its workload.
Models come only from `kvlayout init-model` (written into a temporary
directory and loaded by both sides); nothing is downloaded.

Rows (`suite.ROWS`; the modules that hold them in brackets):

1. write      one-token update per layer at 1k/8k/32k context, and the total
              time appending tokens one by one from empty: kvlayout seq and
              cell vs mlx_lm.models.cache.KVCache.              [write_rows]
2. generate   one sequence, greedy: kvlayout run on mlx:seq / mlx:cell vs
              mlx-lm's generate_step (the loop under mlx_lm.generate); token
              ids checked identical.                              [model_rows]
3. batch      ragged prompts (16..1024 tokens): mlx:cell vs mlx-lm
              batch_generate (BatchKVCache, left-padded); identical outputs
              checked; peak K/V bytes.                            [model_rows]
4. prefix     n samples of one prompt: time to first sampled token and K/V
              held, mlx:cell (one prefill, forks) vs mlx-lm (n rows). [model_rows]
5. bookkeep   declare + place + mask (+ grouping) for 64 seqs x 1 token
              beside one layer's attention over the same window.  [cell_rows]
6. grouped    a decode step of 32 sequences x 1k cells: the layout's choice
              (pages read in place here), gathered groups and the dense mask
              vs the ideal (the same SDPA over each sequence's own, already
              contiguous, cells).                                 [cell_rows]
7. fp16       float16 vs float32 attention on this device.       [dtype_rows]
8. decode     `--model DIR`: single-sequence decode tok/s, mlx:seq and mlx:cell
              vs mlx-lm's generate_step on the same directory, and mlx:seq
              drawing tokens ahead vs its host path.            [real_rows]
9. chat       `--model DIR`: 32 chat requests sharing a system prompt, ragged by
              0-7 earlier exchanges each, mlx:cell
              vs batch_generate; identical tokens checked.      [real_rows]
10. serve     `kvlayout bench serve`: K concurrent streaming chat clients
              (1, 4, 16) sharing a 512-token system prompt against
              `kvlayout serve` and `mlx_lm.server`, each its own process on
              127.0.0.1, on --model DIR or SmolLM2: wall time, req/s,
              gen tok/s, time to first token p50/p99, cached tokens;
              answers compared. Run only when named.           [serve_rows]
11. kvq       `kvlayout bench kvq`: quantized K/V cells (q8, q4) on a tiny
              model at head_dim 64 and on --model DIR or SmolLM2: bytes per
              cell and 1k-token sequences per GiB; decode of 1/8/32
              sequences vs float32 K/V; one sequence vs mlx-lm's
              QuantizedKVCache; 16 requests batched vs mlx-lm's one-at-a-time
              quantized server path; agreement with float (token match, logit
              error). Run only when named.                        [kvq_rows]
12. shapes    a decode step's attention, the step for one layer (declare,
              place, write, plan, attend) and a model's step (that once,
              then 29 later layers: write, attend), against the per-sequence
              ideal for H_kv x D = 1x32, 2x64, 3x64, 8x128, 8 and 32
              sequences, fresh or after 256 interleaved decode steps with
              forks and frees. Run only when named.             [shape_rows]
13. lockstep  `--model DIR`: N sequences of one prompt length (8 x 256,
              32 x 64) decoding together on mlx:cell vs mlx-lm's model and
              cache on the same unpadded [N, L] batch: a whole model's
              decode step against its per-sequence ideal.      [real_rows]
14. host      the host's own time per decode step (the driving thread's CPU
              time outside mx.async_eval, per token) on the tiny preset: one
              sequence, mlx:seq and mlx:cell vs mlx-lm's generate_step at 2
              and 8 layers (split per layer and per step), and 8 and 32
              sequences, mlx:cell vs batch_generate.            [host_rows]

The heading names the BLAS MLX multiplies with (`kvlayout.runner.blas`: a
fast OpenBLAS by default on Linux); `--blas PATH|none` picks another.

Sizes are in `sizes`; timing in `timing`; the table in `table`, the plot in
`plot`, the progress on stderr in `progress`; `suite.run_suite` runs the rows,
printing each row's lines (and rewriting --out's files) as it finishes. mlx-lm and matplotlib come with the
`bench` extra (`peers`). The rows drive the layouts through their faces and
`update_and_fetch`, and time or inspect beyond them only what a layout makes
public on purpose (the pools, the cell cache's `step_groups`/`step_mask` and
`attention_path`); reading the cell table goes through `layouts`, nowhere else.
"""
