"""The node's store of weights received from a head: each unit kept under its content digest.

Layout, under ``$MLXPIPE_HOME/received/``:

- ``units/<digest>.safetensors``: a complete unit, named by its digest (``unit_digests.py``:
  of its header and its data), so a unit whose content changed is another file, received
  again, and one that did not is never sent twice, whatever model or range it came with.
- ``units/<digest>.partial`` and ``.chunks``: a unit on its way, written in place chunk by
  chunk (each checked against its SHA-256 first), and the SHA-256 of each chunk that
  arrived (32 zero bytes: not yet). A transfer killed halfway resumes where it stopped.
  When the last chunk is in, the unit's digest is made from those checksums (nothing is
  hashed again) and the file renamed into place only if it is the digest offered.
- ``<stage key>/``: what ``Load`` reads, an mlx-lm folder: ``config.json`` (and
  ``generation_config.json``) and ``model-<unit>.safetensors``, a hard link to each unit
  of a range. Named by all of that, so never changed once made.

Pure Python and file I/O only: no MLX.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import Dict, Iterable, List, Mapping, Tuple

from mlxpipe.shards.models.unit_digests import PIECE_BYTES, combine, file_prefix, hash_file
from mlxpipe.shards.models.weights import (CHUNK_BYTES, WeightsError, chunk_count, chunk_size, data_start,
                                           is_unit_name, unit_file)

logger = logging.getLogger(__name__)

_DIGEST = re.compile(r"^[0-9a-f]{64}$")
_HASH = 32                      # bytes of a chunk's SHA-256 in a ``.chunks`` file
_MISSING = b"\0" * _HASH
FILES = ("config.json", "generation_config.json")  # the small files a stage needs, sent whole


def check_digest(unit: str, digest: str) -> None:
    if not is_unit_name(unit):
        raise WeightsError(f"unit name {unit!r} is not one of embed, head, layer-NNNNN")
    if not _DIGEST.match(digest):
        raise WeightsError(f"unit {unit} is offered without a digest (64 hex digits; got {digest[:70]!r}): "
                           "the head runs an older mlxpipe than this node")


def check_files(files: Mapping[str, bytes]) -> None:
    """The small files of an offer: only those a stage needs, and JSON."""
    for name, data in files.items():
        if name not in FILES:
            raise WeightsError(f"file {name!r} is not one a stage needs")
        try:
            json.loads(data)
        except (UnicodeDecodeError, ValueError) as err:
            raise WeightsError(f"file {name} of the offer is not JSON: {err}") from None


def stage_key(files: Mapping[str, bytes], units: Mapping[str, str]) -> str:
    """The name of the folder that holds ``files`` and ``units`` (unit -> digest)."""
    what = {"files": {n: hashlib.sha256(d).hexdigest() for n, d in files.items()}, "units": dict(units)}
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:32]


class Receiver:
    """The received-weights store of a node (module docstring)."""

    def __init__(self, home: Path, chunk_bytes: int = CHUNK_BYTES):
        self.root = home / "received"
        self.dir = self.root / "units"
        self.chunk_bytes = chunk_bytes

    def _paths(self, digest: str) -> Tuple[Path, Path, Path]:
        if not _DIGEST.match(digest):
            raise WeightsError(f"unit digest {digest[:70]!r} is not 64 hex digits")
        return (self.dir / f"{digest}.safetensors", self.dir / f"{digest}.partial", self.dir / f"{digest}.chunks")

    def has(self, digest: str) -> bool:
        return self._paths(digest)[0].exists()

    def need(self, unit: str, digest: str, header: bytes, data_bytes: int) -> List[int]:
        """Chunks of ``unit`` (of content ``digest``) still missing; starts a new partial
        file when none is there."""
        check_digest(unit, digest)
        final, partial, hashes = self._paths(digest)
        if final.exists():
            return []
        count = chunk_count(data_bytes, self.chunk_bytes)
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        prefix = file_prefix(header)
        if partial.exists() and hashes.exists():
            with open(partial, "rb") as f:
                same = f.read(len(prefix)) == prefix
            if same and hashes.stat().st_size == count * _HASH and \
                    partial.stat().st_size == len(prefix) + data_bytes:
                have = hashes.read_bytes()
                return [i for i in range(count) if have[i * _HASH:(i + 1) * _HASH] == _MISSING]
        with open(partial, "wb") as f:  # a fresh (sparse) file: header, then room for the data
            f.write(prefix)
            f.truncate(len(prefix) + data_bytes)
        hashes.write_bytes(_MISSING * count)
        return list(range(count))

    def write_chunk(self, unit: str, digest: str, index: int, data: bytes, sha256: bytes) -> bool:
        """Write one chunk if its checksum holds; returns False for a corrupted chunk.
        Renames the unit into place when it is complete and its digest is ``digest``."""
        final, partial, hashes = self._paths(digest)
        if final.exists():
            return True
        if not partial.exists() or not hashes.exists():
            raise WeightsError(f"unit {unit} was not offered first (call Have)")
        count = hashes.stat().st_size // _HASH
        if not 0 <= index < count:
            raise WeightsError(f"chunk {index} of unit {unit} is out of range [0, {count})")
        if len(sha256) != _HASH or sha256 == _MISSING or hashlib.sha256(data).digest() != sha256:
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
        try:
            fd = os.open(hashes, os.O_RDWR)
        except FileNotFoundError:  # another receiver in this home completed it meanwhile (the same bytes)
            return self.has(digest)
        try:  # only after the data is on disk
            os.pwrite(fd, sha256, index * _HASH)
            have = os.pread(fd, count * _HASH, 0)
        finally:
            os.close(fd)
        if all(have[i * _HASH:(i + 1) * _HASH] != _MISSING for i in range(count)):
            self._finish(unit, digest, have)
        return True

    def _finish(self, unit: str, digest: str, hashes: bytes) -> None:
        """The last chunk is in: into place if it is the unit offered, else gone."""
        final, partial, chunks = self._paths(digest)
        if self.chunk_bytes == PIECE_BYTES:  # the chunks are the pieces of the digest
            with open(partial, "rb") as f:
                prefix = f.read(data_start(partial))
            got = combine(prefix, (hashes[i:i + _HASH] for i in range(0, len(hashes), _HASH)))
        else:
            got = hash_file(partial)
        if got != digest:
            partial.unlink(missing_ok=True)
            chunks.unlink(missing_ok=True)
            raise WeightsError(f"unit {unit} as received has digest {got[:16]}, not the {digest[:16]} offered "
                               "(did the head's model change while it was sent?); offer it again")
        os.replace(partial, final)
        chunks.unlink()

    def verified_bytes(self, digests: Iterable[str]) -> int:
        """Data bytes of these units received and verified so far (complete, or chunk by chunk)."""
        total = 0
        for digest in set(digests):
            final, partial, hashes = self._paths(digest)
            try:
                if final.exists():
                    total += final.stat().st_size - data_start(final)
                    continue
                data = partial.stat().st_size - data_start(partial)
                have = hashes.read_bytes()
            except FileNotFoundError:  # none, or completed (renamed) since, by a receiver writing now
                continue
            total += sum(chunk_size(data, i // _HASH, self.chunk_bytes)
                         for i in range(0, len(have), _HASH) if have[i:i + _HASH] != _MISSING)
        return total

    def complete(self, digests: Iterable[str]) -> bool:
        return all(self.has(d) for d in digests)

    def stage_dir(self, files: Mapping[str, bytes], units: Mapping[str, str]) -> Path:
        """The folder ``Load`` reads for a range: ``files`` and a link to each of ``units``
        (unit -> digest, all complete), made once (module docstring)."""
        check_files(files)
        for unit, digest in units.items():
            check_digest(unit, digest)
        final = self.root / stage_key(files, units)
        if all((final / n).exists() for n in [*files, *map(unit_file, units)]):
            return final
        shutil.rmtree(final, ignore_errors=True)  # (one a user emptied: made again)
        tmp = self.root / f".tmp-{final.name}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(mode=0o700, parents=True)
        for name, data in files.items():
            (tmp / name).write_bytes(data)
        for unit, digest in units.items():
            source = self._paths(digest)[0]
            try:
                os.link(source, tmp / unit_file(unit))
            except OSError:  # a file system without hard links
                (tmp / unit_file(unit)).symlink_to(os.path.relpath(source, tmp))
        try:
            os.rename(tmp, final)
        except OSError:  # made meanwhile by another Load: the same content
            shutil.rmtree(tmp, ignore_errors=True)
        return final

