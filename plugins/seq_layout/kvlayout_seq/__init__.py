"""The "seq" layout for kvlayout: one sequence, flat or ring layers, rewind.

`kvlayout_seq.bookkeeping` is the tensor-free planning (importable without
MLX); `kvlayout_seq.mlx_cache.SeqCache` is the MLX face built by the plugin.
"""
