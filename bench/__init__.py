"""fused_remat's benchmark suite: `python -m bench --help`, or `pytest bench --benchmark-only` on a GPU."""
