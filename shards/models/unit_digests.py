"""Units named by their content, as files: the digest the head offers for each unit it
can send (``weights.py``) and a node checks against its own copy and its received files,
without MLX.

A unit's digest is a SHA-256 of the file a node writes for it (``Receiver``): the 8-byte
length and the safetensors header (``Unit.header``: its tensors' names, dtypes, shapes and
offsets), then the SHA-256 of each ``PIECE_BYTES`` piece of its data region, the pieces
it travels in (``CHUNK_BYTES``). So the pieces hash in parallel, a node that received a
unit checks it from the checksums its chunks came with (hashing nothing again), and a
copy of the same tensors in other files (another sharding, another order) has the same
digests.

Hashing reads every byte once, on ``THREADS`` threads; the result is kept in
``$MLXPIPE_HOME/digests/``, one file per model folder, each unit with the (size, mtime,
ctime, inode) of every file it draws from, and its header's SHA-256: a restart does not
hash an unchanged model again, and a file changed in place (same names, same sizes) is
hashed again. A file changed less than ``RACY_NS`` before it was hashed is not kept (its
timestamps might not show a second change in the same tick; git's "racy" files).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import struct
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Dict, Iterable, List, Mapping, Optional, Tuple

from mlxpipe.shards.models.weights import CHUNK_BYTES, Unit, chunk_count, chunk_size, read_header

logger = logging.getLogger(__name__)

PIECE_BYTES = CHUNK_BYTES  # a unit's data is hashed in the pieces it travels in
THREADS = min(8, os.cpu_count() or 2)  # reading and hashing: the disk, not the cores, sets the pace
RACY_NS = 2_000_000_000    # a file this recent when hashed is hashed again next time
DIR = "digests"            # under $MLXPIPE_HOME
_DOMAIN = b"mlxpipe unit v1\0"
_HEX = re.compile(r"[0-9a-f]{64}")
_VERSION = 1
_MAX_CACHE_BYTES = 64 << 20

_pool: Optional[ThreadPoolExecutor] = None
_pool_lock = threading.Lock()
_file_locks: Dict[Path, threading.Lock] = {}


def _threads() -> ThreadPoolExecutor:
    """One pool for the process: offers to several stages at once share the disk."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(THREADS, thread_name_prefix="unit-digest")
        return _pool


def file_prefix(header: bytes) -> bytes:
    """What a unit's file starts with: its header's length, then the header."""
    return struct.pack("<Q", len(header)) + header


def combine(prefix: bytes, pieces: Iterable[bytes]) -> str:
    """A unit's digest (hex) from its file's prefix and its data pieces' SHA-256s."""
    h = hashlib.sha256(_DOMAIN)
    h.update(prefix)
    for piece in pieces:
        h.update(piece)
    return h.hexdigest()


def file_sha256(path: Path) -> Optional[str]:
    """A small file's SHA-256 (hex), or None when it is absent (config.json and the like)."""
    try:
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except FileNotFoundError:
        return None


def submit_unit(unit: Unit) -> List[Future]:
    """The SHA-256s of ``unit``'s pieces, read from its source files on the shared threads."""
    pool = _threads()
    return [pool.submit(lambda i: hashlib.sha256(unit.read(i, PIECE_BYTES)).digest(), i)
            for i in range(unit.chunks(PIECE_BYTES))]


def hash_unit(unit: Unit) -> str:
    """``unit``'s digest, read from its source files now."""
    return combine(file_prefix(unit.header()), (p.result() for p in submit_unit(unit)))


def hash_file(path: Path) -> str:
    """The digest of a unit's own file (one a node wrote): its header as it is, its data in pieces."""
    header, start = read_header(path)  # (checks the header's size)
    del header
    data = path.stat().st_size - start
    with open(path, "rb") as f:
        prefix = f.read(start)

    def piece(i: int) -> bytes:
        with open(path, "rb") as f:
            f.seek(start + i * PIECE_BYTES)
            return hashlib.sha256(f.read(chunk_size(data, i, PIECE_BYTES))).digest()

    pool = _threads()
    pieces = [pool.submit(piece, i) for i in range(chunk_count(data, PIECE_BYTES))]
    return combine(prefix, (p.result() for p in pieces))


def _stat(path: Path) -> List[int]:
    st = os.stat(path)  # (a link, as in the Hugging Face cache: the file it points to)
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]


def _files(unit: Unit) -> Dict[str, List[int]]:
    return {str(p): _stat(p) for p in sorted({t.path for t in unit.tensors})}


def cache_file(home: Path, folder: Path) -> Path:
    """Where the digests of ``folder``'s units are kept."""
    name = hashlib.sha256(str(folder.resolve()).encode()).hexdigest()[:32]
    return home / DIR / f"{name}.json"


def _read_cache(path: Path) -> dict:
    try:
        with open(path, "rb") as f:
            kept = json.loads(f.read(_MAX_CACHE_BYTES))
    except (OSError, ValueError):
        return {}
    if not isinstance(kept, dict) or kept.get("version") != _VERSION or kept.get("piece") != PIECE_BYTES:
        return {}
    units = kept.get("units")
    return units if isinstance(units, dict) else {}


def _write_cache(path: Path, folder: Path, add: Dict[str, dict]) -> None:
    """Merge ``add`` into the kept digests (another process may have written some since)."""
    lock = _file_locks.setdefault(path, threading.Lock())
    with lock:
        units = _read_cache(path)
        units.update(add)
        try:
            path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            tmp = path.with_name(f".tmp-{path.name}-{os.getpid()}-{threading.get_ident()}")
            tmp.write_text(json.dumps({"version": _VERSION, "piece": PIECE_BYTES, "folder": str(folder),
                                       "units": units}, sort_keys=True))
            os.replace(tmp, path)
        except OSError as err:  # a read-only home: hashed again next time
            logger.warning("could not keep the weights' digests in %s: %s", path, err)


def unit_digests(home: Path, folder: Path, units: Mapping[str, Unit]) -> Dict[str, str]:
    """The digest of each of ``units`` (of the model folder ``folder``): kept ones where
    every file a unit draws from is as it was when it was hashed, the rest hashed now
    (every piece of every unit at once, on the threads) and kept."""
    path = cache_file(home, folder)
    kept = _read_cache(path)
    out: Dict[str, str] = {}
    todo: Dict[str, Tuple[Unit, Dict[str, List[int]], str]] = {}
    for name, unit in units.items():
        prefix = file_prefix(unit.header())
        header, files = hashlib.sha256(prefix).hexdigest(), _files(unit)
        entry = kept.get(name)
        if isinstance(entry, dict) and entry.get("header") == header and entry.get("files") == files and \
                _HEX.fullmatch(str(entry.get("digest"))):
            out[name] = entry["digest"]
        else:
            todo[name] = (unit, files, header)
    hashed, t0, new = sum(u.data_bytes for u, _, _ in todo.values()), time.perf_counter(), {}
    for _ in range(3):  # a unit whose files change while it is hashed is hashed again
        began = time.time_ns()
        pieces = {name: submit_unit(unit) for name, (unit, _, _) in todo.items()}
        for name, (unit, files, header) in list(todo.items()):
            out[name] = combine(file_prefix(unit.header()), (p.result() for p in pieces[name]))
            after = _files(unit)
            if after != files:
                todo[name] = (unit, after, header)
                continue
            del todo[name]
            if all(began - max(s[1], s[2]) > RACY_NS for s in files.values()):
                new[name] = {"digest": out[name], "header": header, "files": files}
        if not todo:
            break
    if todo:
        logger.warning("%s kept changing while it was hashed (%s): its digests may not match what is sent",
                       folder, ", ".join(sorted(todo)[:3]))
    if new:
        _write_cache(path, folder, new)
    if hashed:
        seconds = time.perf_counter() - t0
        logger.info("hashed %.1f MB of %s in %.2f s (%.0f MB/s)", hashed / 1e6, folder, seconds,
                    hashed / 1e6 / max(seconds, 1e-9))
    return out
