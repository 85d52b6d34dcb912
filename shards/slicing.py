"""One stage's slice of an mlx-lm model: layers [start, end), run by the model's own code.

Any mlx-lm model whose blocks sit in a ``layers`` list can be cut. Rather than
re-implementing each architecture's forward pass, a stage calls the model's own
``__call__`` with the blocks it does not hold swapped for stand-ins:

- blocks before ``start`` pass their input through untouched (``_Skip``);
- block ``start`` on a later stage ignores its input and runs on the
  activations received from the previous stage (``_Enter``);
- block ``end`` raises ``_Leave`` with the activations, so nothing after the
  range (final norm, output head) is built on an earlier stage.

Everything the model does around its blocks (masks, positions, embedding
scale, final norm, head) therefore stays the model's own. MLX is lazy, so the
embedding lookup that a later stage's forward builds from placeholder tokens is
never evaluated, and weights are read from disk only when a computation uses
them: a stage materializes exactly the tensors its range needs.

Cache objects of the blocks a stage does not hold are stand-ins too: each
points at one of the stage's own caches of the same kind, so a model that
builds its attention mask from, say, ``cache[0]`` sees the right offset.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any, List, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache

from mlxpipe.shards.progress import Progress

if TYPE_CHECKING:
    from mlxpipe.shards.quant_spec import QuantSpec

logger = logging.getLogger(__name__)


class _Leave(Exception):
    def __init__(self, hidden: mx.array):
        super().__init__()
        self.hidden = hidden


def _mimic(stand_in: nn.Module, block: nn.Module) -> nn.Module:
    """Give a stand-in the plain attributes of the block it replaces (flags such
    as ``use_sliding`` that the model's code reads), but none of its weights."""
    stand_in.__dict__.update(
        {k: v for k, v in block.__dict__.items() if not k.startswith("_")}
    )
    return stand_in


class _Skip(nn.Module):
    """A block another stage holds."""

    def __call__(self, x, *args, **kwargs):
        return x


class _Exit(nn.Module):
    """The first block after the range: hands the activations out of the forward."""

    def __call__(self, x, *args, **kwargs):
        raise _Leave(x)


class _Inbox:
    hidden: Optional[mx.array] = None


class _Enter(nn.Module):
    """The first block of a later stage: runs on the received activations."""

    def __init__(self, block: nn.Module, inbox: _Inbox):
        super().__init__()
        self.block = block
        self._inbox = inbox

    def __call__(self, x, *args, **kwargs):
        return self.block(self._inbox.hidden, *args, **kwargs)


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


class SlicedModel:
    """Layers ``[start, end)`` of ``model``; the first stage also embeds, the last
    also runs the final norm and output head (returning logits)."""

    def __init__(self, model: nn.Module, start: int, end: int):
        owner = layer_owner(model)
        blocks: List[nn.Module] = owner["layers"]
        n = len(blocks)
        if not (0 <= start < end <= n):
            raise ValueError(f"layer range [{start}, {end}) is not inside the model's [0, {n})")
        self.model = model
        self.start, self.end, self.num_layers = start, end, n
        self.first, self.last = start == 0, end == n
        # The full-length cache layout the model expects, to learn each block's
        # cache kind before the blocks are replaced.
        template = self._full_cache()
        self.blocks = list(blocks[start:end])  # this stage's own blocks
        self._inbox = _Inbox()
        for i in range(n):
            if i == start and not self.first:
                blocks[i] = _mimic(_Enter(blocks[i], self._inbox), blocks[i])
            elif i == end:
                blocks[i] = _mimic(_Exit(), blocks[i])
            elif not start <= i < end:
                blocks[i] = _mimic(_Skip(), blocks[i])
        # For every block outside the range, the index (within the range) of a
        # cache of the same kind to stand in for its own.
        own = [type(c) for c in template[start:end]]
        self._stand_in = []
        for i in range(n):
            if start <= i < end:
                continue
            kind = type(template[i])
            self._stand_in.append((i, own.index(kind) if kind in own else 0))

    def _full_cache(self) -> list:
        if hasattr(self.model, "make_cache"):
            return self.model.make_cache()
        return [KVCache() for _ in range(self.num_layers)]

    def make_cache(self) -> list:
        """Fresh caches for one sequence, one per block of the range."""
        return self._full_cache()[self.start : self.end]

    def __call__(self, tokens: mx.array, hidden: Optional[mx.array], caches: list) -> mx.array:
        """Run the range on ``tokens`` [B, L] (first stage) or ``hidden`` [B, L, D].

        Returns activations [B, L, D], or logits [B, L, V] on the last stage.
        """
        full: List[Any] = [None] * self.num_layers
        full[self.start : self.end] = caches
        for i, j in self._stand_in:
            full[i] = caches[j]
        self._inbox.hidden = hidden
        try:
            return self.model(tokens, cache=full)
        except _Leave as leave:
            return leave.hidden
        finally:
            self._inbox.hidden = None


def load_stage(path: Path, start: int, end: int, strict: bool = True,
               quant: Optional["QuantSpec"] = None) -> tuple[SlicedModel, dict]:
    """Load ``[start, end)`` of the mlx-lm model folder ``path``, lazily.

    Weights stay on disk until the first forward pass reads them; call
    ``warm_up`` to read them now. ``strict=False`` for a folder holding only
    this range's tensors (received from the head). With ``quant`` the folder
    holds a full-precision model and the range is read and quantized now, one
    module at a time (``quantize.py``); the config returned is the quantized one.
    """
    import json

    from mlx_lm.utils import load_model

    from mlxpipe.shards.quantize import QuantizeError, quantize_range
    from mlxpipe.shards.store import BrokenModel

    path = Path(path)
    try:
        if quant is not None:
            model, config = quantize_range(path, start, end, quant)
        else:
            model, config = load_model(path, lazy=True, strict=strict)
    except QuantizeError:
        raise
    except json.JSONDecodeError as err:
        raise BrokenModel(f"{path / 'config.json'} is not valid JSON: {err}") from err
    except KeyError as err:
        raise BrokenModel(f"model folder {path} lacks the tensor {err}") from err
    except RuntimeError as err:  # MLX reading a damaged safetensors file
        raise BrokenModel(f"model folder {path} has a damaged weights file: {err}") from err
    except (ValueError, FileNotFoundError) as err:  # mlx-lm: missing or misshapen tensors, unknown model type
        raise BrokenModel(f"model folder {path} cannot be loaded: {err}") from err
    return SlicedModel(model, start, end), config


def read_weights(stage: SlicedModel, progress: bool = False) -> None:
    """Read the range's blocks from disk one at a time (``progress``: saying how far)."""
    shown = Progress(f"reading layers [{stage.start}, {stage.end})", "layers", total=len(stage.blocks)) \
        if progress else None
    for block in stage.blocks:
        mx.eval(block.parameters())
        if shown is not None:
            shown.update()
    if shown is not None:
        shown.close()


def warm_up(stage: SlicedModel, hidden_size: int) -> int:
    """One throwaway token through the range: reads (materializes) exactly the
    weights the range uses and compiles its kernels. Returns the range's KV-cache
    bytes per token of context (float32 activations assumed on a later stage)."""
    caches = stage.make_cache()
    tokens = mx.zeros((1, 1), dtype=mx.int32)
    hidden = None if stage.first else mx.zeros((1, 1, hidden_size), dtype=mx.float32)
    mx.eval(stage(tokens, hidden, caches))
    per_token = 0
    for c in caches:  # caches allocate ahead; measure per position of what they allocated
        keys, values = getattr(c, "keys", None), getattr(c, "values", None)
        if isinstance(keys, mx.array) and isinstance(values, mx.array) and keys.ndim == 4:
            per_token += (keys.nbytes + values.nbytes) // keys.shape[2]
    del caches
    mx.clear_cache()
    return per_token
