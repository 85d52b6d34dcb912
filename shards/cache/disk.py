"""The prefix cache's second tier: a stage's blocks on its own disk, kept across
evictions, restarts and re-plans.

A stage keeps the prefix blocks the head names (``prefix.BlockStore``) in memory and,
written through on a thread of this tier, on disk: a block the head evicts from memory
stays here, and after ``serve`` restarts, the stage restarts or a node joins again, the
stage reports what its disk holds for the model and range it loads
(``LoadReply.disk_blocks``), from which the head rebuilds its index. Blocks are read
back on the ``Fetch`` RPC's threads, never on the MLX thread, when the head asks, before
the frame that reuses them (``server/core/kv_budget.py``).

Where it lives (``tier_dirs.py``): a directory per stage's weights digest, block size and
KV quantization (a quantized KV cache's apart) under ``$MLXPIPE_HOME/prefix-cache/``, real
and owner-only; in it one directory per writing process, whose files the others read and
never write. A block is one safetensors file,

    <chain hash: 16 hex>-<start>-<end>-<k|s>-<crc32 of the file: 8 hex>.safetensors

with the keys and values of every cache slot of layers ``[start, end)`` (the range of
the stage that wrote it) and, ``s``, the state at the block's end of its state caches
(rotating windows, state-space arrays). A stage whose range changed (a re-plan, a node
that joins) still uses every file that covers its range: in its own directories, and
read only, in those of other ranges with the same weights (``readable``). Arrays are
stored as they are (a quantized cache's keys as their data, scales and biases): ``encode`` takes any tree
of lists, tuples and dicts of arrays and plain values (and mlx-lm's cache objects, by
class), names the arrays by their path and keeps the tree's shape in the metadata.

Faults stay here. A file that is missing, truncated or fails its checksum is dropped
with a log line and the read says so (the head recomputes its positions); a write that
fails (a full disk) stops the writing, never a request. This process's files never
exceed ``limit`` bytes: the head discards least recently used blocks by its estimate of
their size (``discard``), and a write that would still not fit drops this process's
least recently used files first.
"""

from __future__ import annotations

import logging
import os
import queue
import shutil
import threading
import zlib
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from mlxpipe.shards.cache.block_file import declared_size, decode, encode
from mlxpipe.shards.cache.tier_dirs import NAME, claim, private, read_file, subdirs

logger = logging.getLogger(__name__)

DEFAULT_SHARE = 0.10     # of the free disk (plus what the tier holds already), when no bound is given
FLUSH_S = 10.0           # how long a stopping stage waits for the writes still queued
READERS = 4              # threads reading the files of one Fetch
MAX_PENDING_BYTES = 1 << 30  # blocks queued for writing, at most (more are not written: the disk is too slow)


@dataclass
class _File:
    path: Path
    nbytes: int
    crc: int
    start: int
    end: int
    state: bool   # holds the state at the block's end
    own: bool     # in this process's directory (else read only: another's)


@dataclass
class DiskStats:
    reads: int = 0     # blocks read back
    writes: int = 0    # blocks written
    dropped: int = 0   # files found missing, truncated or corrupt
    evicted: int = 0   # own files dropped to fit a write (the head's estimate fell short)


class DiskTier:
    """One stage process's disk tier for one model, block size and layer range (module docstring)."""

    def __init__(self, base: Path, start: int, end: int, limit: Optional[int] = None,
                 share: float = DEFAULT_SHARE, readable: Sequence[Path] = ()):
        self.base = base
        self.readable = list(readable)  # other tiers' roots whose files it may read (``tier_dirs.readable``)
        self.dir, self._lock_fd = claim(base, start, end)
        self.lock = threading.Lock()
        self.files: Dict[int, _File] = {}            # usable blocks: files that cover the range
        self.lru: "OrderedDict[int, None]" = OrderedDict()  # ... least recently used first
        self.stale: "OrderedDict[Path, int]" = OrderedDict()  # own files that do not cover it: dropped first
        self.own_bytes = 0
        self.pending: Dict[int, Tuple[Any, bool, int]] = {}  # queued for writing: (tree, with state, bytes)
        self.pending_bytes = 0
        self.writable = True
        self.stats = DiskStats()
        self.start, self.end = start, end
        self.retarget(start, end, fresh=True)
        if limit is None:
            limit = int(share * (shutil.disk_usage(self.dir).free + self.own_bytes))
        self.limit = limit
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._writer = threading.Thread(target=self._write_loop, name="prefix-disk-writer", daemon=True)
        self._writer.start()
        self._readers = ThreadPoolExecutor(READERS, thread_name_prefix="prefix-disk-reader")
        with self.lock:  # a smaller bound than last time: drop what is over it before anyone is told
            self._room(0)

    # -- the index ------------------------------------------------------------------------

    def retarget(self, start: int, end: int, limit: Optional[int] = None, fresh: bool = False,
                 readable: Optional[Sequence[Path]] = None) -> None:
        """Index what this tier (and ``readable``, if given: other tiers' roots) holds for
        layers ``[start, end)`` (a new range after a re-plan; ``fresh``: the directory was
        just claimed, nothing writes it yet), and hold to ``limit`` bytes from now on, if
        given. Symlinks are left out, never followed."""
        if readable is not None:
            self.readable = list(readable)
        found = []
        for d in [d for base in [self.base, *self.readable] for d in subdirs(base)]:
            for entry in os.scandir(d):
                m = NAME.fullmatch(entry.name)
                if m is None or not entry.is_file(follow_symlinks=False):
                    if fresh and d == self.dir and entry.name.startswith(".tmp-"):  # a write cut short
                        os.unlink(entry.path)
                    continue
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                found.append((d != self.dir, st.st_mtime, int(m[1], 16),
                              _File(Path(entry.path), st.st_size, int(m[5], 16), int(m[2]), int(m[3]),
                                    m[4] == "s", d == self.dir)))
        with self.lock:
            self.start, self.end = start, end
            self.files.clear()
            self.stale.clear()
            self.own_bytes = 0
            for _, _, key, f in sorted(found, key=lambda x: (x[0], x[1])):  # own first, oldest first
                self.own_bytes += f.nbytes if f.own else 0
                if not (f.start <= start and end <= f.end):
                    if f.own:
                        self.stale[f.path] = f.nbytes
                    continue
                held = self.files.get(key)
                if held is not None and (held.state or not f.state):  # a copy no better than one indexed
                    if f.own:
                        self.stale[f.path] = f.nbytes
                    continue
                if held is not None and held.own:
                    self.stale[held.path] = held.nbytes
                self.files[key] = f
            by_age = {f.path: t for _, t, _, f in found}
            self.lru = OrderedDict((k, None) for k in sorted(self.files, key=lambda k: by_age[self.files[k].path]))
            if limit is not None and not fresh:
                self.limit = limit
                self._room(0)

    def blocks(self) -> Tuple[List[int], List[int]]:
        """The blocks it holds, least recently used first, and those of them with their end state."""
        with self.lock:
            keys = [k for k in self.lru]
            return keys, [k for k in keys if self.files[k].state]

    @property
    def count(self) -> int:
        """Blocks it holds for the range (files of its own and others' it reads)."""
        return len(self.files)

    # -- writing (the MLX thread asks; the writer thread writes) --------------------------------

    def put(self, key: int, tree: Any, state: bool, nbytes: int) -> None:
        """Queue block ``key`` (``tree``, evaluated; ``state``: with its end state) for
        writing, unless this tier holds it already as well."""
        with self.lock:
            held = self.files.get(key)
            queued = self.pending.get(key)
            if not self.writable or (held is not None and held.own and (held.state or not state)) \
                    or (queued is not None and (queued[1] or not state)):
                if held is not None:
                    self.lru.move_to_end(key)
                return
            if self.pending_bytes + nbytes > MAX_PENDING_BYTES:
                logger.warning("prefix block %016x not written to disk: %d bytes already wait for the disk",
                               key, self.pending_bytes)
                return
            self.pending[key] = (tree, state, nbytes)
            self.pending_bytes += nbytes
        self._jobs.put(("put", key, tree, state, nbytes, self.start, self.end))

    def discard(self, keys: Sequence[int]) -> None:
        """Drop blocks from this tier (the head's word): own files are deleted, queued
        writes dropped, others' files forgotten."""
        with self.lock:
            for key in keys:
                queued = self.pending.pop(key, None)
                if queued is not None:
                    self.pending_bytes -= queued[2]
                f = self.files.pop(key, None)
                self.lru.pop(key, None)
                if f is not None and f.own:
                    self._jobs.put(("delete", f.path, f.nbytes))

    def _write_loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            try:
                if job[0] == "put":
                    self._write(*job[1:])
                elif job[0] == "delete":
                    self._delete(job[1], job[2])
                elif job[0] == "flush":
                    job[1].set()
            except Exception:  # noqa: BLE001 - the writer must outlive any one block
                logger.exception("prefix-cache disk writer")

    def _delete(self, path: Path, nbytes: int) -> None:
        _unlink(path)
        with self.lock:
            self.own_bytes -= nbytes

    def _room(self, n: int) -> bool:
        """Make room for a file of ``n`` bytes within the bound and reserve it (lock held):
        stale files go first, then own blocks, least recently used first."""
        if n > self.limit:
            return False
        while self.own_bytes + n > self.limit:
            if self.stale:
                path, size = self.stale.popitem(last=False)
            else:
                key = next((k for k in self.lru if self.files[k].own), None)
                if key is None:
                    return False
                f = self.files.pop(key)
                self.lru.pop(key)
                path, size = f.path, f.nbytes
                self.stats.evicted += 1
            _unlink(path)
            self.own_bytes -= size
        self.own_bytes += n
        return True

    def _write(self, key: int, tree: Any, state: bool, nbytes: int, start: int, end: int) -> None:
        with self.lock:
            if self.pending.get(key, (None,))[0] is not tree:  # discarded (or queued again) meanwhile
                return
        try:
            chunks, size = encode(tree, {"key": f"{key:016x}", "start": str(start), "end": str(end)})
        except TypeError as err:
            logger.warning("prefix block %016x cannot be written to disk: %s", key, err)
            self._unqueue(key, tree, nbytes)
            return
        with self.lock:
            fits = self.writable and self._room(size)
        if not fits:
            self._unqueue(key, tree, nbytes)
            return
        tmp = self.dir / f".tmp-{key:016x}"
        try:
            crc = 0
            _unlink(tmp)
            with open(tmp, "wb", opener=private) as f:  # owner-only, never through a symlink
                for chunk in chunks:
                    f.write(chunk)
                    crc = zlib.crc32(chunk, crc)
            path = self.dir / f"{key:016x}-{start}-{end}-{'s' if state else 'k'}-{crc:08x}.safetensors"
            os.replace(tmp, path)
        except OSError as err:  # a full disk, a read-only one: stop writing, serve on
            with self.lock:
                self.own_bytes -= size
                self.writable = False
            logger.warning("the prefix cache's disk tier stops writing (blocks stay in memory only until the "
                           "stage loads again): %s", err)
            try:
                os.unlink(tmp)
            except OSError:
                pass
            self._unqueue(key, tree, nbytes)
            return
        with self.lock:
            if self.pending.get(key, (None,))[0] is not tree:  # discarded while it was written
                self.own_bytes -= size
                _unlink(path)
                return
            del self.pending[key]
            self.pending_bytes -= nbytes
            self.stats.writes += 1
            if not (start <= self.start and self.end <= end):  # written for a range it was since moved off
                self.stale[path] = size
                return
            old = self.files.get(key)
            if old is not None and old.own and old.path != path:  # a copy without the state, replaced
                self.own_bytes -= old.nbytes
                _unlink(old.path)
            self.files[key] = _File(path, size, crc, start, end, state, True)
            self.lru[key] = None
            self.lru.move_to_end(key)

    def _unqueue(self, key: int, tree: Any, nbytes: int) -> None:
        with self.lock:
            if self.pending.get(key, (None,))[0] is tree:
                del self.pending[key]
                self.pending_bytes -= nbytes

    def flush(self, timeout: float = FLUSH_S) -> bool:
        """Wait (up to ``timeout``) for the writes queued so far; whether they are done."""
        done = threading.Event()
        self._jobs.put(("flush", done))
        return done.wait(timeout)

    def close(self, timeout: float = FLUSH_S) -> None:
        """Finish the queued writes (up to ``timeout``), then let the directory go."""
        self.flush(timeout)
        self._jobs.put(None)
        self._readers.shutdown(wait=False, cancel_futures=True)
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the lock
            self._lock_fd = None

    # -- reading (the Fetch RPC's threads) ----------------------------------------------------

    def read(self, keys: Sequence[int]) -> List[Tuple[int, Any, str]]:
        """Blocks ``keys`` as trees, in order, read in parallel: (key, tree, "") for each
        until the first that cannot be read, which comes as (key, None, why); then any
        other that was read and failed (the rest are not read). A file that is missing,
        truncated or corrupt is dropped here."""
        ahead: "OrderedDict[int, Any]" = OrderedDict()  # a few reads in flight at a time, in order
        out, todo, failed = [], iter(keys), False
        while True:
            while not failed and len(ahead) < 2 * READERS and (key := next(todo, None)) is not None:
                ahead[key] = self._readers.submit(self._read, key)
            if not ahead:
                return out
            key, fut = ahead.popitem(last=False)
            if failed and fut.cancel():
                continue
            tree, why = fut.result()
            if not failed or tree is None:
                out.append((key, tree, why))
            failed = failed or tree is None

    def _read(self, key: int) -> Tuple[Any, str]:
        with self.lock:
            queued = self.pending.get(key)
            f = self.files.get(key)
        if queued is not None:  # not written yet: still in memory
            return queued[0], ""
        if f is None:
            return None, "not on this stage's disk"
        try:
            data = read_file(f.path)
        except FileNotFoundError:
            why = "its file is missing"
        except OSError as err:
            why = f"its file cannot be read ({err})"
        else:
            if len(data) != f.nbytes:
                why = f"its file is truncated ({len(data)} of {f.nbytes} bytes)"
            elif zlib.crc32(data) != f.crc:
                size = declared_size(data)
                short = size is not None and len(data) < size
                why = f"its file is truncated ({len(data)} of {size} bytes)" if short else "its file fails its checksum"
            else:
                try:
                    tree, meta = decode(data)
                    if meta.get("key") != f"{key:016x}":
                        raise ValueError(f"it holds block {meta.get('key')}")
                except (ValueError, KeyError, TypeError, IndexError, AttributeError, ImportError) as err:
                    why = f"its file does not read as a block ({err})"
                else:
                    with self.lock:
                        self.stats.reads += 1
                        if key in self.lru:
                            self.lru.move_to_end(key)
                    return tree, ""
        self._drop(key, f, why)
        return None, why

    def _drop(self, key: int, f: _File, why: str) -> None:
        with self.lock:
            if self.files.get(key) is not f:
                return
            del self.files[key]
            self.lru.pop(key, None)
            self.stats.dropped += 1
            if f.own:
                self.own_bytes -= f.nbytes
        logger.warning("prefix block %016x on disk (%s): %s; dropped, its positions are computed again",
                       key, f.path, why)
        if f.own:
            _unlink(f.path)


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
