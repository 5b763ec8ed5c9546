"""The "cell" layout for kvlayout: many sequences over one pool of per-token cells.

`table` (the cell table) and `stepper` (the step protocol) are neutral:
integers and numpy only. `cache` is the MLX face.
"""
