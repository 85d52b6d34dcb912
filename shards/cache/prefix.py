"""A stage's prefix cache: blocks of prefixes it has computed, kept under the head's hashes.

The head owns the index of which blocks every stage holds (``server/core/prefix_index.py``)
and says, frame by frame, which cached blocks a sequence starts from
(``reuse``), which of a sequence's completed blocks to keep (``store``, and
``snap``: keep the state at the end of the last of them too) and which blocks
to drop (``evict``). A stage never decides any of it, so stages can never
disagree about where a sequence starts.

A block is positions ``[k * block_tokens, (k + 1) * block_tokens)``. Of the
stage's positional caches (``caches.sliceable``: mlx-lm's ``KVCache``, or a
row of a decode group's ``BatchKVCache``, and their quantized forms) it holds
those positions' keys and values, in the form the cache holds them when the
block is kept: at full precision while the sequence is short of its KV
quantization point (``kv_quant.py``), quantized after. A sequence whose blocks
include quantized ones starts with quantized caches (the full-precision parts
quantized as mlx-lm's ``to_quantized`` would: per position, exactly). Of its
state caches (rotating windows, state-space and linear-attention arrays:
``caches.py``) it holds a snapshot of the state at the block's end, but
only when the head asked (``snap``): such state is valid for exactly that
prefix, and costs far more than a block of keys. A sequence starts after blocks
``k0 .. kn`` when the stage holds all of them and, if it has state caches, the
state at the end of ``kn`` (``startable``). It gets fresh caches holding the
blocks' keys and values and that state, so cached blocks are never shared with
live sequences and can be dropped at any time.

With a disk tier (``disk_cache.DiskTier``), every block kept is written there too, on
its own thread, and a block evicted from memory stays there. A block held only on disk
is read back when the head asks (``fetch``, on the Fetch RPC's threads): it waits,
staged for the sequence named, for that sequence's first frame, which starts from it as
from a block in memory; the ``store`` of that frame keeps it in memory (``keep``
adopts the staged block); a ``free`` of the sequence drops what it did not take. A
frame's ``discard`` drops blocks from the disk tier too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, CacheList, QuantizedKVCache

from mlxpipe.proto import pipeline_pb2 as pb
from mlxpipe.proto.errors import FrameError
from mlxpipe.shards.cache import kinds
from mlxpipe.shards.cache.disk import DiskTier
from mlxpipe.shards.cache.quantized import BatchQuantizedKVCache
from mlxpipe.shards.params.kv import KvQuant


@dataclass
class Block:
    kv: list                                # per cache: its keys and values (a list of pairs for a CacheList),
                                            # None for a state cache
    state: Optional[Dict[int, dict]] = None  # per state cache: its snapshot at the block's end
    nbytes: int = 0


def _cut(c, a: int, b: int, row: int):
    """Copies of positions [a, b) of a sliceable cache (row ``row`` of a batched one)."""
    if isinstance(c, CacheList):
        return [_cut(k, a, b, row) for k in c.caches]
    if c.keys is None:  # a cache its layer never fills
        return None
    if isinstance(c, (BatchKVCache, BatchQuantizedKVCache)):
        pad = c.left_padding[row].item()
        cut = lambda x: mx.contiguous(x[row : row + 1, :, pad + a : pad + b])  # noqa: E731
    else:
        cut = lambda x: mx.contiguous(x[..., a:b, :])  # noqa: E731
    # Copies (the sequence's buffers may go); quantized: mx.quantize's three parts of each.
    return tuple(tuple(map(cut, t)) if isinstance(t, (tuple, list)) else cut(t) for t in (c.keys, c.values))


def _fill(c, parts: list, n: int, kv: Optional[KvQuant]):
    """The cache ``c`` (empty) filled with the concatenation of blocks' ``parts`` (from
    ``_cut``): ``c`` itself, or a quantized cache in its place where some are quantized."""
    if isinstance(c, CacheList):
        c.caches = tuple(_fill(k, [p[i] for p in parts], n, kv) for i, k in enumerate(c.caches))
        return c
    if any(p is None for p in parts):
        return c
    if all(not isinstance(p[0], tuple) for p in parts):
        c.keys = mx.concatenate([p[0] for p in parts], axis=2)
        c.values = mx.concatenate([p[1] for p in parts], axis=2)
        c.offset = n
        return c
    q = QuantizedKVCache(group_size=kv.group_size, bits=kv.bits)
    as_q = [tuple(x if isinstance(x, tuple) else mx.quantize(x, group_size=kv.group_size, bits=kv.bits) for x in p)
            for p in parts]
    q.keys, q.values = (tuple(mx.concatenate([p[j][i] for p in as_q], axis=2) for i in range(3)) for j in (0, 1))
    q.offset = n
    return q


class BlockStore:
    def __init__(self, block_tokens: int, kv: Optional[KvQuant] = None, disk: Optional[DiskTier] = None,
                 slots: Sequence[int] = ()):
        """``kv``: how quantized blocks were quantized; ``disk``: the disk tier, or None; ``slots``: the
        model's cache slot of each of the stage's caches (what a block on disk is keyed by within the file)."""
        if block_tokens < 1:
            raise ValueError("block_tokens must be positive")
        self.block_tokens = block_tokens
        self.kv = kv  # how quantized blocks were quantized (None: the stage keeps its KV at full precision)
        self.blocks: Dict[int, Block] = {}
        self.nbytes = 0
        self.disk = disk
        self.slots = list(slots)
        self.staged: Dict[int, Dict[int, Block]] = {}  # sequence -> blocks fetched for its first frame

    def __contains__(self, key: int) -> bool:
        return key in self.blocks

    def __len__(self) -> int:
        return len(self.blocks)

    def startable(self, key: int, caches: Sequence, staged: Optional[Dict[int, Block]] = None) -> bool:
        """Whether a sequence with caches like ``caches`` can start after block ``key``
        (held, or in ``staged``)."""
        block = (staged or {}).get(key) or self.blocks.get(key)
        if block is None:
            return False
        return block.state is not None or all(kinds.sliceable(c) for c in caches)

    def starts(self, caches: Sequence) -> List[int]:
        """The blocks a sequence can start after."""
        return [k for k in self.blocks if self.startable(k, caches)]

    def keep(self, key: int, caches: Sequence, index: int, row: int = -1, snap: bool = False,
             staged: Optional[Block] = None) -> None:
        """Keep block ``index`` of a sequence under ``key``: ``staged`` (read back from
        disk), or from its own caches, or from row ``row`` of batched caches; with
        ``snap``, the state caches' state now (the caches must be at the block's end).
        A key already held keeps what it has, and gains the state if it lacked it. The
        disk tier gets what it lacks."""
        block, write = self.blocks.get(key), False
        counted = block.nbytes if block is not None else 0  # (a staged block comes with its size: not yet counted)
        if block is None and staged is not None:
            block = self.blocks[key] = staged
        elif block is None:
            a = index * self.block_tokens
            kv = [_cut(c, a, a + self.block_tokens, row) if kinds.sliceable(c) else None for c in caches]
            block, write = Block(kv), True
            self.blocks[key] = block
            mx.eval(kinds.arrays(kv))
        if snap and block.state is None and not all(kinds.sliceable(c) for c in caches):
            block.state = {i: kinds.row_snapshot(c, row) for i, c in enumerate(caches) if not kinds.sliceable(c)}
            mx.eval(kinds.arrays(block.state))
            write = True
        block.nbytes = kinds.nbytes(block.kv) + kinds.nbytes(block.state)
        self.nbytes += block.nbytes - counted
        if write and self.disk is not None:
            self.disk.put(key, self._tree(block), block.state is not None, block.nbytes)

    def keep_named(self, entry: pb.SeqEntry, caches: Sequence, row: int = -1,
                   staged: Optional[Dict[int, Block]] = None) -> None:
        """Keep the blocks a frame's entry names (``store``: in memory, taking those
        ``staged`` for it; then ``spill``: on disk only), with the state at the end of
        the last when it says ``snap``."""
        last = len(entry.store) + len(entry.spill) - 1
        for i, key in enumerate(entry.store):
            self.keep(key, caches, entry.store_first + i, row, snap=entry.snap and i == last,
                      staged=(staged or {}).get(key))
        for i, key in enumerate(entry.spill, len(entry.store)):
            self.spill(key, caches, entry.store_first + i, row, snap=entry.snap and i == last)

    def spill(self, key: int, caches: Sequence, index: int, row: int = -1, snap: bool = False) -> None:
        """Write block ``index`` of a sequence to the disk tier only, as ``keep`` would keep it."""
        if self.disk is None or key in self.blocks:  # (a block held is on disk already)
            return
        a = index * self.block_tokens
        block = Block([_cut(c, a, a + self.block_tokens, row) if kinds.sliceable(c) else None for c in caches])
        if snap and not all(kinds.sliceable(c) for c in caches):
            block.state = {i: kinds.row_snapshot(c, row) for i, c in enumerate(caches) if not kinds.sliceable(c)}
        mx.eval(kinds.arrays(block.kv), kinds.arrays(block.state))
        nbytes = kinds.nbytes(block.kv) + kinds.nbytes(block.state)
        self.disk.put(key, self._tree(block), block.state is not None, nbytes)

    def _tree(self, block: Block) -> dict:
        """A block as its disk file holds it: by the model's cache slots, not the stage's."""
        state = None if block.state is None else {self.slots[i]: s for i, s in block.state.items()}
        return {"kv": {slot: kv for slot, kv in zip(self.slots, block.kv)}, "state": state}

    def _block(self, tree: dict) -> Optional[Block]:
        """A block read from disk, for this stage's slots (None: it lacks one of them)."""
        kv, state = tree["kv"], tree.get("state")
        if any(slot not in kv for slot in self.slots):
            return None
        mine = None if state is None else {i: state[s] for i, s in enumerate(self.slots) if s in state}
        block = Block([kv[s] for s in self.slots], mine or None)
        block.nbytes = kinds.nbytes(block.kv) + kinds.nbytes(block.state)
        return block

    def fetch(self, seq_id: int, keys: Sequence[int]) -> Tuple[List[int], List[int]]:
        """Read blocks ``keys`` back from disk (or take them from memory, where an eviction
        the head sent has not arrived yet), in order, until one fails; stage them for
        sequence ``seq_id``'s first frame. Returns (the keys staged, the keys that could not
        be read: they are not on this stage's disk any more). Runs on a thread of its own,
        never the MLX thread."""
        got: Dict[int, Block] = {}
        todo = []
        for key in keys:
            block = self.blocks.get(key)
            if block is not None:
                got[key] = block
            else:
                todo.append(key)
        dropped = []
        for key, tree, _ in (self.disk.read(todo) if self.disk is not None and todo else []):
            block = None if tree is None else self._block(tree)
            if block is None:  # (after the first, only failures come back)
                dropped.append(key)
            elif not dropped:
                got[key] = block
        loaded = []
        for key in keys:
            if key not in got:
                break
            loaded.append(key)
        self.staged[seq_id] = {k: got[k] for k in loaded}
        return loaded, dropped

    def unstage(self, seq_id: int) -> Dict[int, Block]:
        """The blocks fetched for a sequence, no longer staged."""
        return self.staged.pop(seq_id, {})

    def discard(self, keys: Iterable[int]) -> None:
        """Drop blocks from the disk tier too."""
        if self.disk is not None:
            self.disk.discard(list(keys))

    def drop(self, keys: Iterable[int]) -> None:
        for key in keys:
            block = self.blocks.pop(key, None)
            if block is not None:
                self.nbytes -= block.nbytes

    def clear(self) -> None:
        self.blocks.clear()
        self.staged.clear()
        self.nbytes = 0

    def start(self, keys: Sequence[int], caches: list, staged: Optional[Dict[int, Block]] = None) -> int:
        """Fill a new sequence's empty caches with the blocks ``keys`` (held, or ``staged``
        for it), in order (the state caches with the last one's state; a cache where some
        blocks are quantized becomes a quantized one, in place); returns the positions they hold."""
        staged = staged or {}
        blocks = [staged.get(k) or self.blocks[k] for k in keys]
        n = len(blocks) * self.block_tokens
        for i, c in enumerate(caches):
            if kinds.sliceable(c):
                caches[i] = _fill(c, [b.kv[i] for b in blocks], n, self.kv)
            else:
                kinds.restore(c, blocks[-1].state[i])
        return n


def check_blocks(store: Optional["BlockStore"], template: Sequence, frame: pb.Frame, e: pb.SeqEntry) -> None:
    """The prefix-cache instructions of one entry of ``frame``, for a stage holding ``store``
    (None: no prefix cache) whose sequences have caches like ``template``; raises ``FrameError``."""
    if not (e.reuse or e.store or e.spill or e.context):
        return
    if store is None:
        raise FrameError(f"sequence {e.seq_id}: this stage keeps no prefix cache")
    b = store.block_tokens
    evicting = set(frame.evict)
    if e.reuse:
        if frame.kind != pb.Frame.PREFILL or e.offset != len(e.reuse) * b:
            raise FrameError(f"sequence {e.seq_id}: a prefill that reuses {len(e.reuse)} blocks of {b} "
                             f"positions starts at offset {len(e.reuse) * b}, not {e.offset}")
        staged = store.staged.get(e.seq_id, {})
        missing = [k for k in e.reuse if (k not in store or k in evicting) and k not in staged]
        if missing:
            raise FrameError(f"sequence {e.seq_id}: prefix block {missing[0]:016x} is not held here",
                             "FAILED_PRECONDITION")
        if not store.startable(e.reuse[-1], template, staged):
            raise FrameError(f"sequence {e.seq_id}: this stage holds no state at the end of prefix block "
                             f"{e.reuse[-1]:016x}, so nothing can start after it", "FAILED_PRECONDITION")
    if e.context and not e.reuse:
        raise FrameError(f"sequence {e.seq_id}: penalty context comes only with reused blocks")
    end = (e.store_first + len(e.store) + len(e.spill)) * b
    if end > e.offset:
        raise FrameError(f"sequence {e.seq_id}: blocks up to {end // b} are not all before offset {e.offset}")
    if e.spill and store.disk is None:
        raise FrameError(f"sequence {e.seq_id}: this stage has no disk tier to spill blocks to")
    if e.snap and (not (e.store or e.spill) or end != e.offset):
        raise FrameError(f"sequence {e.seq_id}: `snap` keeps the state at the end of the last stored block, "
                         f"which must end at the frame's offset {e.offset}")
