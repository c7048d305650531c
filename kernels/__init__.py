"""Understudy's Metal kernels and their pure-MLX references (imports mlx only).

The engine reaches them through `kernels.dispatch` alone; see docs/ARCHITECTURE.md.
"""
