"""Vision-language models (mlx-vlm's) as a pipeline runs them: the language model
cut into stages like any other, the vision tower run once per image.

mlx-vlm (``pip install 'mlxpipe[vision]'``) holds the model code: its ``Model``
is a vision tower (with its projector) and a ``language_model``. A stage runs
the language model only, wrapped in ``TextPart``, an ``nn.Module`` that looks to
``slicing.SlicedModel`` like an mlx-lm model: a ``layers`` list, ``make_cache``
with mlx-lm's cache classes (so every cache machinery of a stage applies), and a
call ``(inputs, cache)`` that returns logits. Two things a text model never gets
reach it as keywords:

- ``splice``: rows that replace the token embeddings at some positions (the
  image's placeholder tokens), on the first stage. Every other embedding is the
  model's own lookup, and the language model's own scaling applies to all rows,
  as in mlx-vlm's ``get_input_embeddings``.
- ``positions``: the rotary positions of these tokens where they are not the
  cache offsets: ``[A, B, L]`` (Qwen-VL's three axes: time, height, width) or
  ``[B, L]`` (one position per token, the same on every axis). Without them a
  multi-axis model gets the cache offsets on every axis, as a text prompt has.

The tower (``Tower``) runs each image through the model's own
``get_input_embeddings`` over a prompt of that image's placeholder tokens alone,
so whatever a family does to its features before they replace the tokens
(Gemma 3 divides by the square root of the hidden size, which its language model
multiplies back) is the model's own; the rows at the placeholder positions are
the image's embeddings.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn

from mlxpipe.shards.models.weights import is_vision, read_header

logger = logging.getLogger(__name__)


class NoVision(ValueError):
    """A model, or an install, that cannot take images; the message says why."""


def mlx_vlm_installed() -> bool:
    """Whether mlx-vlm can be imported (without importing it: that takes seconds)."""
    import importlib.util

    return importlib.util.find_spec("mlx_vlm") is not None


def has_tower(config: dict) -> bool:
    """Whether a model's config describes a vision tower (mlx-vlm's models have one)."""
    return isinstance(config.get("vision_config"), dict) and bool(config["vision_config"])


def vision_model_type(config: dict) -> Optional[str]:
    """mlx-vlm's name for the model's architecture, or None where mlx-vlm is not installed
    or has no such model."""
    if not has_tower(config) or not mlx_vlm_installed():
        return None
    from mlx_vlm.utils import get_model_and_args

    try:
        get_model_and_args(dict(config))
    except (ValueError, KeyError, ImportError):
        return None
    from mlx_vlm.utils import get_model_type

    return get_model_type(config)


def takes_images(path: Path) -> bool:
    """Whether the model folder at ``path`` is served as a vision-language model: its
    config has a vision tower that mlx-vlm (installed) can build, and its weights hold
    the tower (mlx-lm's own conversions of these models drop it)."""
    path = Path(path)
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    if vision_model_type(config) is None:
        return False
    return any(is_vision(name) for name in _tensor_names(path))


def _tensor_names(path: Path) -> List[str]:
    names: List[str] = []
    for f in sorted(path.glob("*.safetensors")):
        try:
            header, _ = read_header(f)
        except (OSError, ValueError):
            continue
        names += [k for k in header if k != "__metadata__"]
    return names


def load_vlm(path: Path, lazy: bool = True, strict: bool = True) -> Tuple[nn.Module, dict]:
    """mlx-vlm's whole model at ``path`` (lazily: nothing is read until used) and its config."""
    if not mlx_vlm_installed():
        raise NoVision("serving images needs mlx-vlm: pip install 'mlxpipe[vision]'")
    from mlx_vlm.utils import load_config, load_model

    config = load_config(path)
    model = load_model(Path(path), lazy=lazy, strict=strict)
    return model, config


def load_text_part(path: Path, strict: bool = True) -> Tuple["TextPart", dict]:
    """The language model of the vision-language model at ``path``, as a stage runs it
    (lazily; ``strict=False``: a folder holding only some of its tensors, received from the
    head). Its tower is never read."""
    vlm, config = load_vlm(path, lazy=True, strict=strict)
    return TextPart(vlm), config


# -- the language model, as a stage runs it ---------------------------------------------------


def _mlx_lm_cache(c):
    """mlx-lm's cache of the kind an mlx-vlm cache ``c`` is (a stage's machinery knows mlx-lm's)."""
    from mlx_lm.models import cache as lm

    name = type(c).__name__
    if name == "KVCache":
        return lm.KVCache()
    if name == "RotatingKVCache":
        return lm.RotatingKVCache(max_size=c.max_size, keep=getattr(c, "keep", 0))
    if name == "ChunkedKVCache":
        return lm.ChunkedKVCache(c.chunk_size)
    if name == "ArraysCache":
        return lm.ArraysCache(len(c.cache))
    raise NoVision(f"mlx-vlm's {name} has no mlx-lm counterpart a stage can run")


class TextPart(nn.Module):
    """mlx-vlm's language model, as ``slicing.SlicedModel`` runs an mlx-lm model."""

    def __init__(self, vlm: nn.Module):
        super().__init__()
        self.language_model = vlm.language_model
        self.model_type = getattr(vlm, "model_type", None) or getattr(vlm.config, "model_type", "")
        # Qwen-VL's family: rotary positions on three axes, computed from the images' grids.
        self.multi_axis = hasattr(self.language_model, "get_rope_index")

    @property
    def layers(self):
        lm = self.language_model
        return lm.model.layers if hasattr(lm, "model") and hasattr(lm.model, "layers") else lm.layers

    def make_cache(self):
        made = self.language_model.make_cache() if hasattr(self.language_model, "make_cache") else None
        if made is None:
            from mlx_lm.models.cache import KVCache

            return [KVCache() for _ in self.layers]
        return [_mlx_lm_cache(c) for c in made]

    def embed(self, inputs: mx.array) -> mx.array:
        return self.language_model.model.embed_tokens(inputs)

    def __call__(self, inputs: mx.array, cache=None, splice=None, positions=None):
        kwargs: Dict[str, Any] = {}
        if splice is not None:
            at, rows = splice
            h = self.embed(inputs)
            B, L, D = h.shape
            flat = h.reshape(B * L, D)
            flat[at] = rows.astype(h.dtype)
            kwargs["inputs_embeds"] = flat.reshape(B, L, D)
        if self.multi_axis:
            kwargs["position_ids"] = self._positions(inputs, cache, positions)
        out = self.language_model(inputs, cache=cache, **kwargs)
        return out.logits if hasattr(out, "logits") else out

    @staticmethod
    def _positions(inputs: mx.array, cache, positions) -> mx.array:
        """``[3, B, L]`` rotary positions: as given, or the cache offsets on every axis."""
        B, L = inputs.shape
        if positions is None:
            offset = cache[0].offset if cache else 0
            if isinstance(offset, mx.array) and offset.ndim:
                positions = offset[:, None] + mx.arange(L)[None]
            else:
                positions = mx.broadcast_to(mx.arange(int(offset), int(offset) + L)[None], (B, L))
        if positions.ndim == 2:
            positions = positions[None]
        if positions.shape[0] == 1:  # one position per token: the same on every axis
            positions = mx.broadcast_to(positions, (3, B, L))
        return positions.astype(mx.int32)
