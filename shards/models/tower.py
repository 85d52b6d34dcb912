"""A vision-language model's image side, as the head runs it: the processor that
turns an image into pixels and its placeholder tokens, the tower that turns the
pixels into the rows that replace those tokens, and the positions of a prompt.

All of it is mlx-vlm's (the model's ``get_input_embeddings``, its processor, its
language model's ``get_rope_index``); what is ours is that each image goes
alone, so that an image is turned into rows once and the rows can be kept by its
content, however many prompts and turns hold it:

- ``Processor.expand``: the chat template writes one marker per image (Qwen's
  ``<|image_pad|>``, Gemma's ``<start_of_image>``, Pixtral's ``[IMG]``); the
  model's processor, given that marker and one image, writes what the marker
  becomes for that image (its run of placeholder tokens, with whatever the family
  puts around and between them) and makes the image's pixels. The processor's
  tokenizer call is caught, not made: the prompt is tokenized by the head, which
  keeps what clients wrote as text (``server/api/chat_template.Prompts``).
- ``Tower.rows``: the model's own ``get_input_embeddings`` over a prompt of the
  image's placeholder tokens alone; the rows are what replaces those tokens in any
  prompt (mlx-vlm merges them position by position). The language model's
  embedding table is never read here: a stand-in gives zeros for the placeholders,
  which the merge overwrites.
- ``Tower.positions``: a prompt's rotary positions where the model has its own
  (``get_rope_index``: Qwen-VL's three axes, from each image's grid), and how far
  the positions after the prompt run from the token count (``rope_deltas``).
"""

from __future__ import annotations

import hashlib
import inspect
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlxpipe.shards.models.vision import NoVision, load_vlm

logger = logging.getLogger(__name__)

# What ``get_input_embeddings`` may hand the language model besides the embeddings that a
# pipeline carries: positions (computed here for the whole prompt) and a mask mlx-vlm's
# language models do not read. Anything else (Qwen3-VL's deepstack features, Llama 3.2's
# cross-attention states) would have to reach layers past the first stage.
CARRIED = {"inputs_embeds", "position_ids", "rope_deltas", "attention_mask_4d", "attention_mask"}


@dataclass
class ProcessedImage:
    """One image as the model's processor made it."""

    inputs: Dict[str, Any]   # the processor's arrays for this image alone (pixel_values, image_grid_thw, ...)
    expansion: str           # what the template's marker becomes for it
    tokens: int              # placeholder tokens it takes in the prompt
    digest: bytes = b""      # its content (``digest``): what the prefix cache and the head's rows key on


@dataclass
class Expanded:
    text: str
    images: List[ProcessedImage] = field(default_factory=list)


class _Recording:
    """The processor's tokenizer, whose call records the text it was asked to encode and
    encodes nothing (the head tokenizes the prompt; the processor's arrays are what is wanted)."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self.text = None

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)

    def __call__(self, text=None, *args, **kwargs):
        self.text = text if text is not None else (args[0] if args else kwargs.get("text"))
        return {"input_ids": [[]], "attention_mask": [[]]}


def digest(image) -> bytes:
    """An image's content: its size, mode and pixels (a PIL image), whatever file it came in."""
    h = hashlib.sha256(f"{image.mode}:{image.size};".encode())
    h.update(image.tobytes())
    return h.digest()


class Processor:
    """The model's processor (mlx-vlm's ``load_processor``), one image at a time."""

    def __init__(self, path: Path):
        from mlx_vlm.utils import load_processor

        self.processor = load_processor(str(path), add_detokenizer=False)
        self.image_token = getattr(self.processor, "image_token", None)
        if not self.image_token:
            raise NoVision(f"the processor of {path} names no image token")
        self.marker = self._marker()

    def _marker(self) -> str:
        """What the chat template writes for one image and the processor expands: the
        family's begin-of-image marker where it has one (Gemma), else its image token."""
        tok = self.processor.tokenizer
        boi = getattr(self.processor, "boi_token", None)
        try:
            shown = tok.apply_chat_template([{"role": "user", "content": [{"type": "image"}]}], tokenize=False,
                                            add_generation_prompt=False)
        except Exception:  # noqa: BLE001 - a template that renders no image part
            shown = ""
        return boi if boi and boi in shown else self.image_token

    def _inputs(self, image) -> Tuple[Dict[str, Any], str]:
        """One image through the processor: its arrays, and what its marker becomes."""
        from mlx_vlm.utils import process_image

        proc = self.processor
        real = proc.tokenizer
        proc.tokenizer = recording = _Recording(real)
        try:
            out = proc(text=[self.marker], images=[process_image(image, None, proc.image_processor)])
        finally:
            proc.tokenizer = real
        text = recording.text[0] if isinstance(recording.text, (list, tuple)) else recording.text
        return {k: np.asarray(v) for k, v in out.items() if k not in ("input_ids", "attention_mask")}, text

    def process(self, image) -> ProcessedImage:
        inputs, text = self._inputs(image)
        return ProcessedImage(inputs, text, text.count(self.image_token), digest(image))

    def expand(self, text: str, images: Sequence) -> Expanded:
        """``text`` (a rendered prompt with one marker per image, in order) with each marker
        replaced by what it becomes for its image; a marker count that is not the image
        count is a ValueError."""
        parts = text.split(self.marker)
        if len(parts) - 1 != len(images):
            raise ValueError(f"the prompt holds {len(parts) - 1} image markers for {len(images)} images")
        done = [self.process(im) for im in images]
        out = parts[0] + "".join(p.expansion + rest for p, rest in zip(done, parts[1:]))
        return Expanded(out, done)


class _Zeros(nn.Module):
    """Stands in for the language model's embedding on the head: zeros of its width and
    dtype (the rows of placeholders, which the merge overwrites); the table is never read."""

    def __init__(self, dims: int, dtype):
        super().__init__()
        self._dims, self._dtype = dims, dtype

    def __call__(self, ids):
        return mx.zeros((*ids.shape, self._dims), dtype=self._dtype)

    def as_linear(self, x):  # (a tied head: never reached from the tower)
        raise NotImplementedError


class Tower:
    """The vision tower and projector of the model at ``path`` (mlx-vlm's), with the
    language model's positions; nothing of the language model's blocks is read."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.model, self.config = load_vlm(self.path, lazy=True, strict=True)
        cfg = self.model.config
        self.image_token_id = next((v for v in (getattr(cfg, "image_token_id", None),
                                                getattr(cfg, "image_token_index", None)) if v is not None), None)
        if self.image_token_id is None:
            raise NoVision(f"{self.path}: the config names no image token")
        lm = self.model.language_model
        embed = lm.model.embed_tokens
        self.hidden_size = int(embed.weight.shape[-1])
        self.dtype = embed.weight.dtype
        lm.model.embed_tokens = _Zeros(self.hidden_size, self.dtype)
        self.rope_index = getattr(lm, "get_rope_index", None)
        self.bytes = self._read()

    def _read(self) -> int:
        """Read the tower's weights now (every parameter outside the language model's)."""
        from mlx.utils import tree_flatten

        own = [v for k, v in tree_flatten(self.model.parameters()) if not k.startswith("language_model.")]
        mx.eval(own)
        return sum(v.nbytes for v in own)

    def rows(self, image: ProcessedImage) -> mx.array:
        """The image's rows ``[tokens, hidden]``: what replaces its placeholder tokens."""
        ids = mx.array([[self.image_token_id] * image.tokens])
        inputs = {k: mx.array(v) for k, v in image.inputs.items()}
        pixels = inputs.pop("pixel_values")
        out = self.model.get_input_embeddings(ids, pixels, mask=mx.ones(ids.shape, dtype=mx.int32), **inputs)
        extra = [k for k, v in out.to_dict().items() if v is not None and k not in CARRIED]
        if extra:
            raise NoVision(f"{self.config.get('model_type')} hands its language model {', '.join(extra)} besides "
                           "the image's embeddings, which a pipeline does not carry yet")
        rows = out.inputs_embeds[0]
        mx.eval(rows)
        return rows

    def timed_rows(self, image: ProcessedImage) -> Tuple[mx.array, float]:
        t0 = time.perf_counter()
        rows = self.rows(image)
        return rows, time.perf_counter() - t0

    def positions(self, ids: Sequence[int], images: Sequence[ProcessedImage]) -> Optional[Tuple[np.ndarray, int]]:
        """The prompt's rotary positions ``[axes, len(ids)]`` and the shift of every position
        after it (position = index + shift), where the model has its own scheme; else None."""
        if self.rope_index is None:
            return None
        params = inspect.signature(self.rope_index).parameters
        kwargs = {}
        for name in params:
            got = [im.inputs[name] for im in images if name in im.inputs]
            if got:
                kwargs[name] = mx.array(np.concatenate(got))
        pos, delta = self.rope_index(mx.array([list(ids)]), **kwargs)
        pos = np.asarray(pos)
        if pos.ndim == 2:  # one axis
            pos = pos[None]
        return pos[:, 0, :].astype(np.int64), int(np.asarray(delta).reshape(-1)[0])
