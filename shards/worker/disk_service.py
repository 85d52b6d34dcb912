"""A stage's prefix-cache disk tier as its servicer keeps it across Loads
(``shards/cache/disk.py`` is the tier itself): which tier a Load gets, what Load and
Health report of it, and the ``Fetch`` RPC that reads its blocks back.

A Load's tier is the directory of what the stage loaded (its ``WeightsDigest``, the
block size and the KV quantization: ``shards/cache/tier_dirs.py``); it outlives a shard
of the same weights, and a stage loaded with another range reads the files of the
tiers of ranges that cover it with the same weights. ``Fetch`` reads on a thread of
its own, never the MLX thread.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Optional

from mlxpipe.proto import pipeline_pb2 as pb
from mlxpipe.shards.cache.block_file import block_file_bytes
from mlxpipe.shards.cache.disk import FLUSH_S, DiskTier
from mlxpipe.shards.cache.tier_dirs import TierRefused, open_tier, readable, tier_root
from mlxpipe.shards.models.store import mlxpipe_home

logger = logging.getLogger(__name__)


class DiskService:
    """The disk tier of the model loaded (None: none), and the node's own bound on it."""

    def __init__(self, disk_bytes: Optional[int] = None):
        self.disk_bytes = disk_bytes  # the node's own bound (None: the head's, else a share of free disk)
        self.tier: Optional[DiskTier] = None  # for the model loaded (MLX thread)

    def for_load(self, request: pb.LoadRequest, digest, kv=None) -> Optional[DiskTier]:
        """The tier for this Load (None: none, or its directory is refused), kept from the last
        Load where the weights (``digest``: the stage's ``WeightsDigest``), block size and KV
        quantization (``kv``: the ``KvQuant`` the stage applies; its blocks are stored as they
        are) are the same (MLX thread). A node's own bound wins over the head's."""
        limit = self.disk_bytes
        if limit is None and request.HasField("prefix_disk_bytes"):
            limit = request.prefix_disk_bytes
        home = mlxpipe_home()
        root = tier_root(home, digest.stage, request.block_tokens, kv)
        if self.tier is not None and (limit == 0 or not request.block_tokens or self.tier.base != root):
            self.tier.close()
            self.tier = None
        if limit == 0 or not request.block_tokens:
            return None
        try:
            if self.tier is None:
                open_tier(home, digest, request.block_tokens, kv)
        except (TierRefused, OSError) as err:
            logger.warning("the prefix cache keeps no blocks on disk for layers [%d, %d): %s",
                           request.start, request.end, err)
            return None
        also = readable(home, digest, request.start, request.end, root)
        if self.tier is None:
            self.tier = DiskTier(root, request.start, request.end, limit, readable=also)
            logger.info("prefix cache on disk: %s, %d blocks, %.1f of %.1f MB", self.tier.dir, self.tier.count,
                        self.tier.own_bytes / 1e6, self.tier.limit / 1e6)
        else:
            self.tier.retarget(request.start, request.end, limit, readable=also)
        return self.tier

    def close(self) -> None:
        """The node stops: finish the tier's writes (a while, at most)."""
        if self.tier is not None:
            self.tier.close(FLUSH_S)


def report_load(reply: pb.LoadReply, prefix) -> None:
    """What a Load answers of the disk tier of ``prefix`` (a ``prefix.BlockStore``)."""
    if prefix is None or prefix.disk is None:
        return
    keys, starts = prefix.disk.blocks()
    reply.disk_blocks.extend(keys)
    reply.disk_starts.extend(starts)
    reply.disk_limit_bytes = prefix.disk.limit
    arrays = (6 if reply.HasField("kv_cache") else 2) * len(prefix.slots)  # (quantized: data, scales, biases)
    reply.disk_block_bytes = block_file_bytes(prefix.block_tokens, reply.kv_bytes_per_token, arrays)


def report_health(reply: pb.HealthReply, prefix) -> None:
    """What Health tells of the disk tier of ``prefix``: its size, bound and counters."""
    disk = prefix.disk if prefix is not None else None
    if disk is None:
        return
    reply.prefix_disk_bytes, reply.prefix_disk_blocks = disk.own_bytes, disk.count
    reply.prefix_disk_limit = disk.limit
    stats = reply.stats
    stats.disk_blocks_read, stats.disk_blocks_written = disk.stats.reads, disk.stats.writes
    stats.disk_blocks_dropped = disk.stats.dropped


async def fetch(prefix, request: pb.FetchRequest) -> pb.FetchReply:
    """Read a sequence's blocks back from disk for its first frame, off the MLX thread."""
    got, dropped = await asyncio.to_thread(prefix.fetch, request.seq_id, list(request.keys))
    return pb.FetchReply(loaded=got, dropped=dropped)
