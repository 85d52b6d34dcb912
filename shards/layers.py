"""Where an mlx-lm model keeps its blocks (shared by slicing, quantizing and profiling)."""

from __future__ import annotations

import mlx.nn as nn


def layer_owner(model: nn.Module) -> nn.Module:
    """The module whose ``layers`` list the model's forward iterates."""
    best = None
    for _, module in model.named_modules():
        layers = module.get("layers") if isinstance(module, dict) else None
        if isinstance(layers, list) and layers and all(isinstance(b, nn.Module) for b in layers):
            if best is None or len(layers) > len(best["layers"]):
                best = module
    if best is None:
        raise ValueError(
            f"{type(model).__module__} keeps its blocks in no `layers` list, so it cannot be cut by layer"
        )
    return best
