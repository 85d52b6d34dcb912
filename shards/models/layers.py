"""Where an mlx-lm model keeps its blocks (shared by slicing, quantizing and profiling)."""

from __future__ import annotations

from typing import List

import mlx.nn as nn


def layer_list(model: nn.Module) -> List[nn.Module]:
    """The list of blocks the model's forward iterates (the list object itself, as it
    sits in the module tree: stand-ins are put into it). mlx-lm's models name it with
    their ``layers`` attribute (often a property over ``h``, ``blocks``, ...)."""
    named = getattr(model, "layers", None)
    lists = [v for _, m in model.named_modules() if isinstance(m, dict)
             for v in m.values() if isinstance(v, list) and v and all(isinstance(b, nn.Module) for b in v)]
    if isinstance(named, list) and named:
        for blocks in lists:
            if blocks is named or (len(blocks) == len(named) and all(a is b for a, b in zip(blocks, named))):
                return blocks
    owned = [m["layers"] for _, m in model.named_modules()
             if isinstance(m, dict) and any(m.get("layers") is blocks for blocks in lists)]
    if owned:
        return max(owned, key=len)
    raise ValueError(
        f"{type(model).__module__} keeps its blocks in no `layers` list, so it cannot be cut by layer"
    )


# How configs spell a model's sizes (mlx-lm's ModelArgs take each architecture's own names).
SIZE_KEYS = {
    "hidden_size": ("hidden_size", "n_embd", "d_model", "hidden_dim", "model_dim", "dim"),
    "num_hidden_layers": ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "num_transformer_layers"),
    "vocab_size": ("vocab_size", "num_vocab", "padded_vocab_size"),
}


def with_sizes(config: dict) -> dict:
    """``config`` with ``hidden_size``, ``num_hidden_layers`` and ``vocab_size`` filled in
    from the names its architecture uses, where it lacks them."""
    out = dict(config)
    for key, names in SIZE_KEYS.items():
        if out.get(key) is None:
            found = next((config[n] for n in names if isinstance(config.get(n), int)), None)
            if found is not None:
                out[key] = found
    return out
