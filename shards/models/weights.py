"""Weights for nodes without the model: units, chunks, and the node's received cache.

A model's tensors are grouped into *units*: one per layer (``layer-00012``),
``embed`` (the token embedding) and ``head`` (everything else outside the
layers: final norm, output head). A stage with layers ``[start, end)`` needs
the units of its layers, ``embed`` if it is first (or last with a tied head),
and ``head`` if it is last. A re-plan moves whole layers, so only units that
change hands travel.

Each unit travels as the data region of a safetensors file the node writes
itself: the head sends the header (the unit's tensors, their dtypes, shapes
and offsets) and then the data in fixed-size chunks, each with its SHA-256.
The node writes verified chunks in place, keeps the checksum of each chunk that
arrived, and renames the file into place when every chunk is there, so
a transfer killed halfway resumes where it stopped and nothing half-written
is ever loaded. A node keeps what it received under each unit's content digest
(``received.py``, ``unit_digests.py``), and reuses it whatever model or range it came with.

Pure Python and file I/O only: no MLX (the head uses this too).
"""

from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Tuple

CHUNK_BYTES = 4 << 20
_UNIT = re.compile(r"^(embed|head|layer-\d{5})$")
LAYER_RE = re.compile(r"(?:^|\.)(?:layers|h|blocks)\.(\d+)\.")  # mlx-lm models name their block list so
# Modules only images use (a vision-language model's tower, its projector): the head runs them
# (shards/models/tower.py), so they are a unit of their own, ``vision``, that no stage needs.
VISION_MODULES = ("vision_tower", "vision_model", "visual", "multi_modal_projector", "mm_projector",
                  "vision_embed_tokens", "audio_tower", "audio_model")


def is_vision(name: str) -> bool:
    """Whether a tensor (or module) of this name belongs to a vision-language model's image side
    (under one of ``VISION_MODULES``, as Hugging Face's and mlx-vlm's names put it)."""
    return any(part in VISION_MODULES for part in name.split(".")[:3])


class WeightsError(ValueError):
    """A weights offer or chunk that cannot be taken; the message says why."""


MAX_HEADER_BYTES = 100 << 20  # the largest safetensors JSON header taken as plausible


def _header_size(f, path: Path) -> int:
    raw = f.read(8)
    if len(raw) != 8:
        raise WeightsError(f"{path}: too short to be a safetensors file")
    (n,) = struct.unpack("<Q", raw)
    if n > MAX_HEADER_BYTES:
        raise WeightsError(f"{path}: safetensors header of {n} bytes is larger than {MAX_HEADER_BYTES}")
    return n


def data_start(path: Path) -> int:
    """Where a safetensors file's data region starts."""
    with open(path, "rb") as f:
        return 8 + _header_size(f, path)


def read_header(path: Path) -> Tuple[dict, int]:
    """A safetensors file's header (``__metadata__`` included), and where its data starts."""
    with open(path, "rb") as f:
        n = _header_size(f, path)
        raw = f.read(n)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise WeightsError(f"{path}: unreadable safetensors header ({err})") from None
    if not isinstance(header, dict):
        raise WeightsError(f"{path}: safetensors header is not a JSON object")
    return header, 8 + n


def is_unit_name(name: str) -> bool:
    """Whether ``name`` is a unit's (and so safe in a file name)."""
    return bool(_UNIT.match(name))


def chunk_count(data_bytes: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Chunks a data region of ``data_bytes`` travels in (at least one)."""
    return max(1, -(-data_bytes // chunk_bytes))


def chunk_size(data_bytes: int, index: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Bytes in chunk ``index`` of a data region of ``data_bytes`` (the last may be short)."""
    return min(chunk_bytes, data_bytes - index * chunk_bytes)


@dataclass
class Source:
    """Where one tensor's bytes are on the head."""

    name: str
    dtype: str
    shape: List[int]
    path: Path
    offset: int  # absolute, in the file
    nbytes: int


@dataclass
class Unit:
    name: str
    tensors: List[Source] = field(default_factory=list)

    @property
    def data_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def header(self) -> bytes:
        """The safetensors header of the unit's own file (tensors back to back)."""
        meta, pos = {"__metadata__": {"format": "mlx"}}, 0
        for t in self.tensors:
            meta[t.name] = {"dtype": t.dtype, "shape": t.shape, "data_offsets": [pos, pos + t.nbytes]}
            pos += t.nbytes
        raw = json.dumps(meta, separators=(",", ":")).encode()
        return raw + b" " * (-len(raw) % 8)  # safetensors pads the header to 8 bytes

    def chunks(self, chunk_bytes: int = CHUNK_BYTES) -> int:
        return chunk_count(self.data_bytes, chunk_bytes)

    def read(self, index: int, chunk_bytes: int = CHUNK_BYTES) -> bytes:
        """Bytes ``[index * chunk_bytes, ...)`` of the unit's data region, from the source files."""
        lo, hi = index * chunk_bytes, min((index + 1) * chunk_bytes, self.data_bytes)
        out, pos = bytearray(), 0
        for t in self.tensors:
            a, b = max(lo, pos), min(hi, pos + t.nbytes)
            if a < b:
                with open(t.path, "rb") as f:
                    f.seek(t.offset + a - pos)
                    out += f.read(b - a)
            pos += t.nbytes
        return bytes(out)


def unit_of(name: str) -> str:
    """The unit a tensor (or module) of this name belongs to."""
    if is_vision(name):
        return "vision"
    m = LAYER_RE.search(name)
    return f"layer-{int(m.group(1)):05d}" if m else ("embed" if "embed" in name else "head")


def unit_file(unit: str) -> str:
    """The file a unit lives in, on a node that received it (and in the head's quantized cache)."""
    return f"model-{unit}.safetensors"


def range_unit_names(start: int, end: int, num_layers: int, tied: bool) -> List[str]:
    """The units a stage holding layers ``[start, end)`` needs: its layers, ``embed``
    if it is first (or last with a head ``tied`` to the embedding), ``head`` if last."""
    names = [f"layer-{i:05d}" for i in range(start, end)]
    if start == 0 or (end == num_layers and tied):
        names.append("embed")
    if end == num_layers:
        names.append("head")
    return names


def model_units(folder: Path) -> Dict[str, Unit]:
    """Every unit of the mlx-lm model folder ``folder``, from its safetensors headers."""
    units: Dict[str, Unit] = {}
    for path in sorted(folder.glob("*.safetensors")):
        header, data_start = read_header(path)
        for name, info in header.items():
            if name == "__metadata__":
                continue
            unit = unit_of(name)
            begin, end = info["data_offsets"]
            units.setdefault(unit, Unit(unit)).tensors.append(
                Source(name, info["dtype"], list(info["shape"]), path, data_start + begin, end - begin))
    for u in units.values():
        u.tensors.sort(key=lambda t: t.name)
    return units


def units_for_range(units: Dict[str, Unit], start: int, end: int, num_layers: int) -> List[Unit]:
    """The units a stage holding layers ``[start, end)`` needs."""
    tied = not any("lm_head" in t.name for t in units.get("head", Unit("head")).tensors)
    names = range_unit_names(start, end, num_layers, tied)
    missing = [n for n in names if n.startswith("layer") and n not in units]
    if missing:
        raise WeightsError(f"the model folder has no tensors for {missing[:3]}")
    return [units[n] for n in names if n in units]
