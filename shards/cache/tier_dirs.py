"""Where a stage's prefix-cache disk tier lives (``disk.py`` is the tier itself), and which
directory each process writes.

Layout: ``$MLXPIPE_HOME/prefix-cache/<stage digest>/b<block tokens>[-kv<bits>g<group>]/w<n>/``.
The stage digest (``shards/models/digest.py``: of the tensors the stage loaded, so of its
range, its weights as loaded, their quantization and the config) names the directory:
a model whose weights changed in place, another quantization or another range never
writes into another's. Beside the ``b...`` directories, ``units.json`` lists the stage's
units and their digests, so that a stage whose range changed (a re-plan, a node that
joins) finds the directories of ranges that cover its layers with the same weights and
config (``readable``) and reads their files. Which blocks are hits is still the head's
word: its keys are salted with every stage's units (``server/core/prefix_index.py``),
so a block computed under other weights before this stage's range is never one.

Every directory from the home down is a real directory, never a symlink (one found
there is refused, and the stage runs without a disk tier: ``TierRefused``), the
process's own and owner-only (0700; an existing one is tightened); files are created
0600 and opened without following a symlink (``O_NOFOLLOW``), so that no block is
written, read or deleted outside the home.

One directory per writing process (``w0``, ``w1``, ...), held with an exclusive lock
(``flock`` on its ``lock`` file) for as long as the process uses it, so that two
processes never write the same files; a process claims the unlocked directory whose
files cover most of its layers (its own, after a restart), and reads, never writes,
the files of the others.
"""

from __future__ import annotations

import fcntl
import itertools
import json
import os
import re
import stat
from pathlib import Path
from typing import List, Optional, Tuple

DIR = "prefix-cache"     # under $MLXPIPE_HOME
UNITS = "units.json"     # a stage directory's units and their digests
NAME = re.compile(r"([0-9a-f]{16})-(\d+)-(\d+)-([ks])-([0-9a-f]{8})\.safetensors")  # a block's file
_DIGEST = re.compile(r"[0-9a-f]{32}")
_MAX_UNITS_BYTES = 1 << 20
NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


class TierRefused(Exception):
    """A tier directory that is not a real, private directory of this process's user."""


def tier_root(home: Path, stage_digest: str, block_tokens: int, kv=None) -> Path:
    """Where the disk tier of a stage's weights (``WeightsDigest.stage``), block size and KV
    quantization (``KvQuant``, or None: blocks past a sequence's switch hold its bits) lives."""
    if not _DIGEST.fullmatch(stage_digest):
        raise ValueError(f"stage digest {stage_digest!r} is not 32 hex digits")
    return home / DIR / stage_digest / (f"b{block_tokens}" + (f"-kv{kv.bits}g{kv.group_size}" if kv else ""))


def private_dir(path: Path) -> Path:
    """``path`` as a real directory of this user's, owner-only (made if missing, tightened
    if looser); ``TierRefused`` for a symlink, anything else or another user's."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise TierRefused(f"{path} is {'a symlink' if stat.S_ISLNK(st.st_mode) else 'not a directory'}; "
                          "the prefix cache's disk tier keeps to real directories inside $MLXPIPE_HOME "
                          "(remove it, or point $MLXPIPE_HOME elsewhere)")
    if st.st_uid != os.getuid():
        raise TierRefused(f"{path} belongs to another user (uid {st.st_uid})")
    if stat.S_IMODE(st.st_mode) & 0o077:
        os.chmod(path, 0o700)
    return path


def make_tier(home: Path, root: Path) -> Path:
    """Every directory from ``home`` (exclusive) down to ``root`` made a private real one."""
    home.mkdir(parents=True, exist_ok=True)
    path = home
    for part in root.relative_to(home).parts:
        path = private_dir(path / part)
    return root


def private(path, flags: int) -> int:
    """``open``'s opener of a new file: owner-only, never through a symlink, never one that exists."""
    return os.open(path, flags | os.O_EXCL | NOFOLLOW, 0o600)


def nofollow(path, flags: int) -> int:
    """``open``'s opener of a file that is not a symlink."""
    return os.open(path, flags | NOFOLLOW)


def read_file(path: Path, limit: int = -1) -> bytes:
    """The bytes of the file ``path`` (at most ``limit``), never through a symlink."""
    with open(path, "rb", opener=nofollow) as f:
        return f.read(limit)


def write_private(path: Path, data: bytes) -> None:
    """``data`` as the file ``path`` (0600, replaced whole: written beside it, then renamed)."""
    tmp = path.with_name(f".tmp-{path.name}-{os.getpid()}")
    _unlink(tmp)
    with open(tmp, "wb", opener=private) as f:
        f.write(data)
    os.replace(tmp, path)


def read_units(stage_dir: Path) -> Optional[dict]:
    """The units a stage directory says it holds (None: none, or not readable as such)."""
    try:
        units = json.loads(read_file(stage_dir / UNITS, _MAX_UNITS_BYTES))
    except (OSError, ValueError):
        return None
    return units if isinstance(units, dict) and all(isinstance(v, str) for v in units.values()) else None


def open_tier(home: Path, digest, block_tokens: int, kv=None) -> Path:
    """The tier root of a stage's weights (``digest``: its ``WeightsDigest``), made private
    and with its ``units.json``; ``TierRefused`` where a directory on the way is not ours."""
    root = make_tier(home, tier_root(home, digest.stage, block_tokens, kv))
    if read_units(root.parent) != digest.units:
        write_private(root.parent / UNITS, json.dumps(digest.units, sort_keys=True).encode())
    return root


def readable(home: Path, digest, start: int, end: int, root: Path) -> List[Path]:
    """Other tier roots of the same block size and KV quantization whose stages held
    layers ``[start, end)`` with the same weights and config (``digest.agrees``)."""
    out = []
    try:
        entries = list(os.scandir(home / DIR))
    except OSError:
        return out
    for entry in sorted(entries, key=lambda e: e.name):
        other = Path(entry.path) / root.name
        if entry.name == root.parent.name or not entry.is_dir(follow_symlinks=False):
            continue
        units = read_units(Path(entry.path))
        if units is not None and digest.agrees(units, start, end) and _real_dir(other):
            out.append(other)
    return out


def _real_dir(path: Path) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def subdirs(base: Path) -> List[Path]:
    """The real directories in ``base`` (symlinks left out), by name."""
    try:
        return sorted(Path(e.path) for e in os.scandir(base) if e.is_dir(follow_symlinks=False))
    except OSError:
        return []


# -- the directory a process writes -----------------------------------------------------------


def _lock(directory: Path) -> Optional[int]:
    """An exclusive lock on ``directory`` (its ``lock`` file), or None when another process holds it."""
    try:
        fd = os.open(directory / "lock", os.O_RDWR | os.O_CREAT | NOFOLLOW, 0o600)
    except OSError:  # a symlink where the lock should be
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


def _covers(name: str, start: int, end: int) -> bool:
    m = NAME.fullmatch(name)
    return m is not None and int(m[2]) <= start and end <= int(m[3])


def claim(base: Path, start: int, end: int) -> Tuple[Path, int]:
    """The directory this process writes, locked: the unlocked one whose files cover the
    most of ``[start, end)``, else a new one (owner-only)."""
    base.mkdir(mode=0o700, parents=True, exist_ok=True)
    dirs = subdirs(base)
    score = {d: sum(_covers(e.name, start, end) for e in os.scandir(d)) for d in dirs}
    for d in sorted(dirs, key=lambda d: -score[d]):
        if (fd := _lock(d)) is not None:
            return d, fd
    for i in itertools.count():
        d = base / f"w{i}"
        if not os.path.lexists(d):
            try:
                os.mkdir(d, 0o700)
            except FileExistsError:  # another process made it too: the lock decides
                pass
            if _real_dir(d) and (fd := _lock(d)) is not None:
                return d, fd
