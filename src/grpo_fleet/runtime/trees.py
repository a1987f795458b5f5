"""Typed views of MLX parameter trees (mlx.utils' stubs leave the (key, leaf) pairs untyped)."""

from __future__ import annotations

from typing import Any, cast

import mlx.core as mx
from mlx.utils import tree_flatten


def flat_leaves(tree: Any) -> list[tuple[str, Any]]:
    """`tree_flatten(tree)`: (dotted key, leaf) pairs."""
    return cast(list[tuple[str, Any]], tree_flatten(tree))


def scalar(value: mx.array) -> float:
    """A one-element array as a Python float."""
    return float(cast(float, value.item()))
