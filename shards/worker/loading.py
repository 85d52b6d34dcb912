"""What a stage's ``Load`` does on the MLX thread: its range read (and quantized, and, in a
tensor-parallel group, split: ``group.py``), warmed up, its limits, KV quantization and
prefix cache set, and what the reply says of it.

A group's ranks load in step: each reads and splits its slice, the ranks agree that every
one of them could (``group.agree``) before the first all-reduce of the warm-up, and they keep
only the prefix blocks all of them hold. The leader's reply speaks for the group.
"""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass
from typing import Optional

import mlx.core as mx

from mlxpipe.proto import pipeline_pb2 as pb
from mlxpipe.shards.cache.kinds import kv_switch
from mlxpipe.shards.cache.quantized import KvSwitch
from mlxpipe.shards.models import tensor_parallel as tp
from mlxpipe.shards.models.grammar import tokenizer_from_json
from mlxpipe.shards.models.layers import with_sizes
from mlxpipe.shards.models.profile import offered_memory
from mlxpipe.shards.models.digest import read_weights
from mlxpipe.shards.models.slicing import SlicedModel, load_stage, warm_up
from mlxpipe.shards.models.store import fingerprint, text_config
from mlxpipe.shards.params import wire
from mlxpipe.shards.params.quant import quantized_fingerprint
from mlxpipe.shards.worker import group as groups
from mlxpipe.shards.worker import memory
from mlxpipe.shards.worker.mtp_drafts import load_drafting
from mlxpipe.shards.worker.stage import Shard, ShardLimits

logger = logging.getLogger(__name__)


@dataclass
class Loaded:
    """A loaded shard plus what Load replied, the head's offer of its weights (if any) and, for a
    group's rank, its group."""

    shard: Shard
    reply: pb.LoadReply
    request: pb.LoadRequest
    offer: object = None                # weight_service.Offer: the same request over other weights is another shard
    spec: Optional[groups.Spec] = None  # this node's rank of the stage's group (None: alone)
    group: object = None                # its collective


def load(node, request: pb.LoadRequest) -> Loaded:
    """Load ``request``'s range on ``node`` (a ``StageServicer``: its weights, memory, disk tier
    and options). In a group, every rank at once: ``GroupError`` when the group cannot form or
    broke, the first failure's error on the rank that failed, a ``GroupError`` on the others."""
    spec = groups.Spec.from_wire(request.group) if request.HasField("group") else None
    if spec is None:
        return _finish(node, request, _read(node, request))
    group = groups.join(spec)
    # Every rank runs the same collectives in the same order: each frame finishes before the next
    # item is handed on (no frame launched ahead of another's sums, no block launched as it is built).
    node.mlx.ahead = False
    try:
        read, failure = _read(node, request, spec, group), None
    except Exception as err:  # noqa: BLE001 - every rank hears of it before the first all-reduce
        read, failure = None, err
    if not groups.agree(group, failure is None):
        raise failure or groups.GroupError(f"another rank of the group could not load layers "
                                           f"[{request.start}, {request.end})")
    try:
        loaded = _finish(node, request, read, spec=spec, group=group)
    except Exception as err:  # noqa: BLE001 - past the first all-reduce: the ranks are out of step
        raise groups.GroupError(f"the group broke loading layers [{request.start}, {request.end}): "
                                f"{type(err).__name__}: {err}") from err
    _agree_blocks(group, loaded.shard)
    return loaded


@dataclass
class _Read:
    """A range read lazily (and quantized), split for this rank; nothing computed yet."""

    stage: SlicedModel
    config: dict
    path: object           # the model folder
    quant: object          # how it was quantized on load (None: as stored)
    offered: int           # memory this node offers
    resident: int          # the process's resident bytes before
    before: int            # MLX's active bytes before


def _read(node, request: pb.LoadRequest, spec=None, group=None) -> _Read:
    """The range read lazily (and quantized), split for this rank (``spec``, ``group``)."""
    path, partial = node.weights.model_path(request)
    # Weights received from the head come quantized already; a full-precision
    # folder of our own is quantized here, one module at a time.
    quant = None if partial else wire.quant_from_wire(request.quantization)
    gc.collect()  # let a replaced shard's arrays go before measuring
    mx.clear_cache()
    offered = offered_memory(node.memory_bytes)
    memory.check_load(path, request, quant, offered, ranks=spec.size if spec else 1)  # MemoryShort
    resident, before = memory.resident_bytes(), mx.get_active_memory()
    mx.reset_peak_memory()
    stage, config = load_stage(path, request.start, request.end, not partial, quant, request.vision)
    if spec is not None:
        sums = tp.Sums(group)
        tp.shard_blocks(stage.blocks, request.start, tp.Part(spec.rank, spec.size), sums)  # Unsplittable
        if not spec.leader and stage.last:
            stage.drop_head()  # only the leader runs the final norm, head and sampler
        stage = tp.Taped(stage, sums)
    elif node.mlx.ahead:  # build each block while MLX runs the last (slicing.py)
        stage.launch_blocks()
    return _Read(stage, config, path, quant, offered, resident, before)


def _finish(node, request: pb.LoadRequest, read: _Read, spec=None, group=None) -> Loaded:
    stage, config, path, before = read.stage, read.config, read.path, read.before
    # A group's rank hashes what it computes with: its slice of each layer (so its own disk tier, and a
    # layout of other groups another prefix-cache salt: a miss, never a wrong hit).
    hashing = read_weights(stage, progress=node.progress)  # (on threads, while it warms up)
    # The model's MTP head (last stage; in a group, its leader alone drafts, with the head whole).
    drafting, mtp = load_drafting(request.mtp and (spec is None or spec.leader), stage, path, config, read.quant)
    mlx_peak_bytes = max(mx.get_peak_memory() - before, 0)
    text = with_sizes(text_config(config))
    hidden, vocab = int(text["hidden_size"]), int(text["vocab_size"])
    max_context = int(text.get("max_position_embeddings") or 1 << 20)
    footprint = warm_up(stage, hidden)
    switch, kv_reply = kv_settings(node, request, stage, hidden, footprint.kv_bytes_per_token, spec is not None)
    weight_bytes = max(mx.get_active_memory() - before, 0)
    peak_bytes = memory.load_peak_bytes(read.resident, mx.get_peak_memory() - before)
    model_bytes = sum(f.stat().st_size for f in path.glob("*.safetensors"))
    cap = request.max_cache_bytes or max(read.offered - weight_bytes, 0)
    limits = ShardLimits(
        max_batch=request.max_batch or ShardLimits.max_batch,
        max_chunk_tokens=request.max_chunk_tokens or ShardLimits.max_chunk_tokens,
        max_context=max_context,
        # A group's leader holds the most heads (the first ranks get the extra ones): its cap binds.
        max_cache_bytes=0 if spec and not spec.leader else cap,
        block_tokens=request.block_tokens,
    )
    tokenizer = None
    if request.HasField("tokenizer") and stage.last:
        tokenizer = tokenizer_from_json(request.tokenizer.json, vocab, request.tokenizer.eos_token_ids)
    digest = hashing.result(config)
    shard = Shard(stage, hidden, vocab, limits, tokenizer, switch,
                  node.disk.for_load(request, digest, switch.kv if switch.slots else None), drafting)
    reply = pb.LoadReply(
        model_path=str(path), model_type=config.get("model_type", ""), num_layers=stage.num_layers,
        hidden_size=hidden, vocab_size=vocab, weight_bytes=weight_bytes, model_bytes=model_bytes,
        max_context=max_context, max_cache_bytes=limits.max_cache_bytes,
        fingerprint=request.fingerprint or quantized_fingerprint(fingerprint(path), read.quant),
        unit_digests=digest.units, weights_digest=digest.stage,  # what it computes with (models/digest.py)
        block_tokens=shard.prefix.block_tokens if shard.prefix is not None else 0,
        peak_bytes=peak_bytes, mlx_peak_bytes=mlx_peak_bytes,
        memory_warning=node.metal.settle(weight_bytes, limits.max_cache_bytes,
                                         f"layers [{request.start}, {request.end})"),
        max_rewind=limits.max_rewind if shard.stateful else limits.max_context,
        state_bytes=footprint.state_bytes, vision=request.vision, **mtp.reply(kv_reply),
    )
    if spec is not None:
        reply.group_size = spec.size
        reply.allreduce_seconds = groups.time_allreduce(group, hidden)
        reply.allreduces_per_token = 2 * len(stage.blocks)
        if spec.leader:
            shard.mirror = groups.Mirror(group)
    return Loaded(shard, reply, request, node.weights.offer(request), spec, group)


def _agree_blocks(group, shard: Shard) -> None:
    """Keep only the prefix blocks (in memory, on disk) every rank of the group holds."""
    prefix = shard.prefix
    if prefix is None:
        return
    held = list(prefix.blocks)
    common = groups.common_keys(group, held)
    prefix.drop([k for k in held if k not in common])
    on_disk = prefix.disk.blocks()[0] if prefix.disk is not None else []
    common = groups.common_keys(group, on_disk)
    prefix.discard([k for k in on_disk if k not in common])


def kv_settings(node, request: pb.LoadRequest, stage: SlicedModel, hidden: int, full_bytes: int,
                in_group: bool = False) -> tuple[KvSwitch, dict]:
    """The KV quantization this stage applies (the head's, else the node's own; a group's ranks
    take the head's alone, so that they all apply the same): the switch, and what the Load
    reply says of it: a token's KV bytes as the head is to plan them, before and after the
    switch, and why fewer caches turn quantized than asked (``kv_note``: one line, logged here too)."""
    asked = wire.kv_from_wire(request.kv_cache) if request.HasField("kv_cache") else None
    kv = asked or (None if in_group else node.kv)
    if kv is None:
        return KvSwitch(), {"kv_bytes_per_token": full_bytes, "kv_full_bytes_per_token": full_bytes}
    switch, quantized_bytes, note = kv_switch(stage, hidden, kv)
    if note:
        logger.warning("layers [%d, %d): %s: %s", request.start, request.end, kv, note)
    # The node's own --kv-bits saves memory the head does not plan on: a token counts at full precision.
    return switch, {"kv_bytes_per_token": quantized_bytes if asked else full_bytes,
                    "kv_full_bytes_per_token": full_bytes, "kv_note": note,
                    "kv_cache": wire.kv_to_wire(switch.kv) if switch.slots else None}
