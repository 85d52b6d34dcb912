"""What a frame carries for a vision model, checked and turned into the keywords its
language model's call takes (``shards/models/vision.TextPart``): the first stage's image
rows (``splice``) and every stage's rotary positions (``positions``).

- ``Frame.embeds`` + ``embed_at``: rows that replace the token embeddings at those
  positions of a PREFILL frame's tokens (an image's placeholder tokens; a chunk may
  hold part of an image, or of two). First stage only; not passed on.
- ``Frame.positions``: a PREFILL frame's rotary positions, ``[axes, tokens]``
  (Qwen-VL's three axes inside and after its images).
- ``SeqEntry.position_shift``: a sequence whose positions run ahead of (or behind)
  its cache offsets after its prompt: a token at offset i sits at i + shift (decode
  and verify frames, and prefill frames without explicit positions).

A model whose positions are its cache offsets (Gemma 3, Mistral 3) takes rows but no
positions; a text model takes neither. Nothing here changes state: ``check`` and
``embeds`` run before a frame's work, and refuse with ``FrameError``.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import mlx.core as mx

from mlxpipe.proto import codec
from mlxpipe.proto import pipeline_pb2 as pb
from mlxpipe.proto.errors import FrameError

MAX_AXES = 4


def _vision(model) -> bool:
    return hasattr(model.model, "multi_axis")


def _multi_axis(model) -> bool:
    return bool(getattr(model.model, "multi_axis", False))


def check(frame: pb.Frame, model, n: int) -> None:
    """Refuse image rows or positions that ``model`` (a ``SlicedModel``) cannot take, or that
    do not fit the frame's ``n`` tokens."""
    shifted = any(e.position_shift for e in frame.seqs)
    if not (frame.HasField("embeds") or frame.embed_at or frame.positions or shifted):
        return
    if not _vision(model):
        raise FrameError("this stage runs a text model: a frame for it carries no images nor positions")
    if (frame.positions or shifted) and not _multi_axis(model):
        raise FrameError("this model's positions are its tokens' offsets: a frame for it carries none")
    if frame.positions:
        axes, rest = divmod(len(frame.positions), n) if n else (0, 1)
        if frame.kind != pb.Frame.PREFILL or rest or not 1 <= axes <= MAX_AXES:
            raise FrameError(f"a PREFILL frame's positions are [axes, {n}] (axes 1..{MAX_AXES}), "
                             f"not {len(frame.positions)} values in a {pb.Frame.Kind.Name(frame.kind)} frame")
    if frame.HasField("embeds") or frame.embed_at:
        if frame.kind != pb.Frame.PREFILL or not model.first:
            raise FrameError("image rows go into the first stage's PREFILL frames only")
        at = list(frame.embed_at)
        if any(b <= a for a, b in zip(at, at[1:])) or not at or at[-1] >= n:
            raise FrameError(f"embed_at names positions of the frame's {n} tokens, ascending, each once")


def embeds(frame: pb.Frame, hidden_size: int) -> Optional[mx.array]:
    """The frame's image rows ``[len(embed_at), hidden_size]`` (checked: dtype, shape, finite)."""
    if not frame.HasField("embeds"):
        if frame.embed_at:
            raise FrameError("embed_at names positions, and the frame carries no rows for them")
        return None
    try:
        return codec.decode(frame.embeds, expect_shape=(len(frame.embed_at), hidden_size))
    except codec.WireError as err:
        raise FrameError(f"image rows: {err}") from err


def _shifted(starts: Sequence[int], shifts: Sequence[int], n: int) -> mx.array:
    """``[1, rows, n]``: row r's positions ``starts[r] + shifts[r] + 0 .. n-1``."""
    base = mx.array([s + d for s, d in zip(starts, shifts)], dtype=mx.int32)
    return (base[:, None] + mx.arange(n, dtype=mx.int32)[None])[None]


def shifted(start: int, n: int, shift: int) -> Dict[str, object]:
    """The keywords of a call on ``n`` positions from ``start`` of a sequence shifted by ``shift``
    (positions of a verify frame computed again after a rewind)."""
    return {"positions": _shifted([start], [shift], n)} if shift else {}


def extras(frame: pb.Frame, rows: Optional[mx.array], length: int) -> Dict[str, object]:
    """The keywords one sequence's PREFILL or VERIFY frame adds to its model call (none for
    a text sequence): image rows where its tokens are placeholders, and its positions
    (``length``: its positions before these)."""
    out: Dict[str, object] = {}
    e, n = frame.seqs[0], frame.seqs[0].num_tokens
    if rows is not None:
        out["splice"] = (mx.array(list(frame.embed_at), dtype=mx.int32), rows)
    if frame.positions:
        out["positions"] = mx.array(list(frame.positions), dtype=mx.int32).reshape(-1, 1, n)
    elif e.position_shift:
        out["positions"] = _shifted([length], [e.position_shift], n)
    return out


def decode_positions(frame: pb.Frame, lengths: List[int]) -> Optional[mx.array]:
    """A DECODE frame's positions ``[1, rows, 1]`` where some row's are not its offset (None: all are)."""
    shifts = [e.position_shift for e in frame.seqs]
    return _shifted(lengths, shifts, 1) if any(shifts) else None
