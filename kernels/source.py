"""Kernel sources: `.metal` files shipped as package data, read once."""

from __future__ import annotations

from functools import cache
from importlib import resources


@cache
def metal_source(name: str) -> str:
    """The text of `kernels/<name>.metal` (a kernel body or a header of helpers)."""
    return resources.files("kernels").joinpath(f"{name}.metal").read_text(encoding="utf-8")


def metal_available() -> bool:
    """True where Metal kernels can run (checked per call; callers cache the answer)."""
    import mlx.core as mx

    return bool(mx.metal.is_available())
