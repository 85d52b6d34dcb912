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
The node writes verified chunks in place, keeps a one-byte-per-chunk map of
what arrived, and renames the file into place when every chunk is there, so
a transfer killed halfway resumes where it stopped and nothing half-written
is ever loaded. Received units live under ``$MLXPIPE_HOME/received/<model
fingerprint>/`` and are reused next time.

Pure Python and file I/O only: no MLX (the head uses this too).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Tuple

CHUNK_BYTES = 4 << 20
_UNIT = re.compile(r"^(embed|head|layer-\d{5})$")
_FINGERPRINT = re.compile(r"^[0-9a-f]{8,64}$")
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


# -- the node's side ------------------------------------------------------------------


def received_dir(home: Path, fingerprint: str) -> Path:
    if not _FINGERPRINT.match(fingerprint):
        raise WeightsError(f"model fingerprint {fingerprint!r} is not a hex digest")
    return home / "received" / fingerprint


class Receiver:
    """The received-weights cache of one model on a node."""

    def __init__(self, home: Path, fingerprint: str, chunk_bytes: int = CHUNK_BYTES):
        self.dir = received_dir(home, fingerprint)
        self.chunk_bytes = chunk_bytes

    def _paths(self, unit: str) -> Tuple[Path, Path, Path]:
        if not _UNIT.match(unit):
            raise WeightsError(f"unit name {unit!r} is not one of embed, head, layer-NNNNN")
        return (self.dir / unit_file(unit), self.dir / f"{unit}.partial", self.dir / f"{unit}.chunks")

    def write_files(self, files: Dict[str, bytes]) -> None:
        """Small files that come whole (config.json)."""
        self.dir.mkdir(parents=True, exist_ok=True)
        for name, data in files.items():
            if name not in ("config.json", "generation_config.json"):
                raise WeightsError(f"file {name!r} is not one a stage needs")
            json.loads(data)  # must be JSON
            (self.dir / name).write_bytes(data)

    def need(self, unit: str, header: bytes, data_bytes: int) -> List[int]:
        """Chunks of ``unit`` still missing; starts a new partial file when none is there."""
        final, partial, chunkmap = self._paths(unit)
        count = chunk_count(data_bytes, self.chunk_bytes)
        if final.exists():
            return []
        self.dir.mkdir(parents=True, exist_ok=True)
        prefix = struct.pack("<Q", len(header)) + header
        if partial.exists() and chunkmap.exists():
            with open(partial, "rb") as f:
                same = f.read(len(prefix)) == prefix
            if same and chunkmap.stat().st_size == count:
                have = chunkmap.read_bytes()
                return [i for i in range(count) if not have[i]]
        with open(partial, "wb") as f:  # a fresh (sparse) file: header, then room for the data
            f.write(prefix)
            f.truncate(len(prefix) + data_bytes)
        chunkmap.write_bytes(b"\0" * count)
        return list(range(count))

    def write_chunk(self, unit: str, index: int, data: bytes, sha256: bytes) -> bool:
        """Write one chunk if its checksum holds; returns False for a corrupted chunk.
        Renames the unit into place when it is complete."""
        final, partial, chunkmap = self._paths(unit)
        if final.exists():
            return True
        if not partial.exists() or not chunkmap.exists():
            raise WeightsError(f"unit {unit} was not offered first (call Have)")
        count = chunkmap.stat().st_size
        if not 0 <= index < count:
            raise WeightsError(f"chunk {index} of unit {unit} is out of range [0, {count})")
        if hashlib.sha256(data).digest() != sha256:
            return False
        start = data_start(partial)
        expect = chunk_size(partial.stat().st_size - start, index, self.chunk_bytes)
        if len(data) != expect:
            raise WeightsError(f"chunk {index} of unit {unit} has {len(data)} bytes, expected {expect}")
        fd = os.open(partial, os.O_WRONLY)
        try:
            os.pwrite(fd, data, start + index * self.chunk_bytes)
            os.fsync(fd)
        finally:
            os.close(fd)
        fd = os.open(chunkmap, os.O_WRONLY)
        try:  # only after the data is on disk
            os.pwrite(fd, b"\1", index)
        finally:
            os.close(fd)
        if all(chunkmap.read_bytes()):
            os.replace(partial, final)
            chunkmap.unlink()
        return True

    def verified_bytes(self) -> int:
        """Data bytes received and verified so far (complete units and partial chunks)."""
        total = 0
        for f in self.dir.glob("model-*.safetensors"):
            total += f.stat().st_size - data_start(f)
        for chunkmap in self.dir.glob("*.chunks"):
            partial = chunkmap.with_suffix(".partial")
            try:
                data = partial.stat().st_size - data_start(partial)
                got = chunkmap.read_bytes()
            except FileNotFoundError:  # completed (renamed) since the listing, by a receiver writing now
                continue
            total += sum(chunk_size(data, i, self.chunk_bytes) for i, g in enumerate(got) if g)
        return total

    def complete(self, units: List[str]) -> bool:
        return (self.dir / "config.json").exists() and all(self._paths(u)[0].exists() for u in units)
