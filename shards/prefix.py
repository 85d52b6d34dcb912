"""A stage's prefix cache: KV blocks of prefixes it has computed, kept under the head's hashes.

The head owns the index of which blocks every stage holds (``server/prefix.py``)
and says, frame by frame, which cached blocks a sequence starts from
(``reuse``), which of a sequence's completed blocks to keep (``store``) and
which blocks to drop (``evict``). A stage never decides any of it, so stages
can never disagree about where a sequence starts.

A block is positions ``[k * block_tokens, (k + 1) * block_tokens)`` of every
cache of the stage's layers, copied out of a sequence's caches: its own
(mlx-lm ``KVCache``) or its row of a decode group's ``BatchKVCache``. A
sequence that starts from blocks gets fresh caches holding their
concatenation, so cached blocks are never shared with live sequences and can
be dropped at any time. Only caches that are plain keys and values along a
position axis can be cut like this (mlx-lm's ``KVCache``: GQA and MLA alike);
``supports`` tells, and a stage whose model has others (sliding windows,
state-space layers) reports that it keeps no prefix cache.
"""

from __future__ import annotations

from typing import Dict, Iterable, List, Sequence, Tuple

import mlx.core as mx
from mlx_lm.models.cache import BatchKVCache, KVCache

Block = List[Tuple[mx.array, mx.array]]  # (keys, values) per cache of the stage's layers


def supports(caches: Sequence) -> bool:
    """Whether caches like these can be cut into blocks."""
    return bool(caches) and all(type(c) is KVCache for c in caches)


class BlockStore:
    def __init__(self, block_tokens: int):
        if block_tokens < 1:
            raise ValueError("block_tokens must be positive")
        self.block_tokens = block_tokens
        self.blocks: Dict[int, Block] = {}
        self.nbytes = 0

    def __contains__(self, key: int) -> bool:
        return key in self.blocks

    def __len__(self) -> int:
        return len(self.blocks)

    def keep(self, key: int, caches: Sequence, index: int, row: int = -1) -> None:
        """Keep block ``index`` of a sequence under ``key``: from its own caches, or
        from row ``row`` of batched caches. A key already held stays as it is."""
        if key in self.blocks:
            return
        a = index * self.block_tokens
        b = a + self.block_tokens
        block = []
        for c in caches:
            if isinstance(c, BatchKVCache):
                pad = c.left_padding[row].item()
                k, v = c.keys[row : row + 1, :, pad + a : pad + b], c.values[row : row + 1, :, pad + a : pad + b]
            else:
                k, v = c.keys[..., a:b, :], c.values[..., a:b, :]
            block.append((mx.contiguous(k), mx.contiguous(v)))  # a copy: the sequence's buffers may go
        mx.eval(block)
        self.blocks[key] = block
        self.nbytes += sum(k.nbytes + v.nbytes for k, v in block)

    def drop(self, keys: Iterable[int]) -> None:
        for key in keys:
            block = self.blocks.pop(key, None)
            if block is not None:
                self.nbytes -= sum(k.nbytes + v.nbytes for k, v in block)

    def clear(self) -> None:
        self.blocks.clear()
        self.nbytes = 0

    def start(self, keys: Sequence[int], caches: Sequence[KVCache]) -> int:
        """Fill a new sequence's empty caches with the blocks ``keys``, in order;
        returns the positions they hold."""
        blocks = [self.blocks[k] for k in keys]
        for i, c in enumerate(caches):
            c.keys = mx.concatenate([b[i][0] for b in blocks], axis=2)
            c.values = mx.concatenate([b[i][1] for b in blocks], axis=2)
            c.offset = len(blocks) * self.block_tokens
        return len(blocks) * self.block_tokens
