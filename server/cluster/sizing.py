"""How much each stage and the scheduler may hold, derived from the config tree
(``server/config.py``) and the stages' Load replies: the limits each stage loads with
(``stage_limits``), the KV positions the head may reserve (``kv_token_budget``), the
prefix-cache blocks every stage keeps in memory and on disk (``prefix_blocks``,
``disk_blocks``), and the scheduler's parameters (``scheduler_config``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from mlxpipe.server.config import PLANNED_CONTEXT, ClusterConfig
from mlxpipe.server.core.prefix_index import block_cost, snapshot_every
from mlxpipe.server.core.scheduler_config import SchedulerConfig
from mlxpipe.server.core.speculation import verify_positions
from mlxpipe.shards.params.kv import KvQuant

# A stage keeps twice the KV cache its sequences may fill free: batched caches pad
# their rows to the longest, and a sequence's caches are copied as it joins a decode
# group. The head reserves KV positions by the same rule (``kv_token_budget``), so
# what a plan fits is what the stages serve.
KV_MARGIN = 2


@dataclass(frozen=True)
class StageLimits:
    """What the head asks each stage to hold to, in its Load."""

    max_batch: int = 0          # rows in a decode frame (0: the stage's own limit)
    max_chunk_tokens: int = 0   # tokens in a prefill frame
    max_cache_bytes: int = 0    # KV-cache bytes, cached prefix blocks included (0: no cap)
    block_tokens: int = 0       # positions per prefix-cache block (0: keep no prefix cache)
    disk_bytes: Optional[int] = None  # the prefix cache's disk tier, at most (None: each node's default; 0: none)
    kv: Optional[KvQuant] = None  # how to quantize the KV caches (None: not)
    mtp: bool = False           # the last stage loads the model's MTP head to draft with, where it has one
    vision: bool = False        # run the language model as mlx-vlm's (a vision model: frames carry images)
    tp_backend: str = ClusterConfig.tp_backend  # a tensor group's collective: auto, ring or jaccl (tp_backend.py)


def kv_quant(cfg: ClusterConfig) -> Optional[KvQuant]:
    """The KV quantization the stages are asked for (None: none)."""
    return KvQuant.of(cfg.kv_bits, cfg.kv_group_size, cfg.quantized_kv_start)


def stage_limits(cfg: ClusterConfig, cache_bytes: int) -> StageLimits:
    return StageLimits(max_batch=cfg.max_batch, max_chunk_tokens=cfg.chunk_size, max_cache_bytes=cache_bytes,
                       block_tokens=cfg.block_tokens if cfg.prefix_cache_bytes != 0 else 0, kv=kv_quant(cfg),
                       disk_bytes=cfg.prefix_cache_disk, mtp=uses_mtp(cfg), tp_backend=cfg.tp_backend)


def uses_mtp(cfg: ClusterConfig) -> bool:
    """Whether requests may draft with the model's MTP head (so the last stage loads it)."""
    return cfg.speculate and cfg.speculation in ("auto", "mtp")


def planned_context(cfg: ClusterConfig, model_context: Optional[int]) -> int:
    """Tokens per sequence the planner makes room for: ``cfg.context``, else the model's
    context (``max_position_embeddings``), at most ``PLANNED_CONTEXT``."""
    return cfg.context or min(int(model_context or PLANNED_CONTEXT), PLANNED_CONTEXT)


def kv_token_budget(loads: Sequence) -> int:
    """KV positions the scheduler may reserve, from the stages' Load replies: the tightest
    stage's cache cap over what a token costs there, over ``KV_MARGIN`` (batched
    caches pad rows and copy a sequence's caches as it joins a group)."""
    return min(r.max_cache_bytes // max(r.kv_bytes_per_token, 1) for r in loads) // KV_MARGIN


def prefix_blocks(loads: Sequence, max_kv_tokens: int, cache_bytes: Optional[int]) -> int:
    """Prefix-cache blocks every stage may keep: ``cache_bytes`` on the stage where a
    block costs most (default: half the KV budget; with state snapshots, half of each
    stage's cache bytes); 0 when a stage keeps none."""
    block = loads[0].block_tokens
    if not block or any(r.block_tokens != block for r in loads):
        return 0
    every = snapshot_every(block, [(r.kv_bytes_per_token, r.state_bytes) for r in loads])
    if cache_bytes is None and not every:
        return max_kv_tokens // 2 // block
    fits = [(r.max_cache_bytes // 2 if cache_bytes is None else cache_bytes)
            // max(block_cost(block, r.kv_bytes_per_token, r.state_bytes, every), 1) for r in loads]
    return min(min(fits), max_kv_tokens // block)


def disk_blocks(loads: Sequence) -> int:
    """Prefix-cache blocks every stage's disk tier may hold, from what a block's file
    takes there (its share of the state snapshots included); 0 when a stage has none."""
    block = loads[0].block_tokens
    if not block or any(not r.disk_limit_bytes or r.block_tokens != block for r in loads):
        return 0
    every = snapshot_every(block, [(r.kv_bytes_per_token, r.state_bytes) for r in loads])
    return min(r.disk_limit_bytes // max(r.disk_block_bytes + (r.state_bytes // every if every else 0), 1)
               for r in loads)


def scheduler_config(cfg: ClusterConfig, stages: int, max_kv_tokens: int, blocks: int,
                     row_cost: float, disk: int = 0) -> SchedulerConfig:
    """The scheduler of a pipeline of ``stages`` stages: one group, one prefill frame and
    one VERIFY frame in flight per stage; speculation while no more sequences are live
    than there are stages."""
    return SchedulerConfig(
        max_kv_tokens=max_kv_tokens, block_tokens=cfg.block_tokens, prefix_blocks=blocks, prefix_disk_blocks=disk,
        speculate=cfg.speculate, spec_max_running=stages, spec_depth=cfg.spec_depth,
        spec_positions=verify_positions(row_cost, stages), spec_frames=stages,
        num_groups=cfg.groups or stages, max_batch=cfg.max_batch, chunk_size=cfg.chunk_size, max_stall=cfg.max_stall,
        max_prefill_inflight=stages, max_running=cfg.max_running, max_waiting=cfg.max_waiting,
        kv_start=cfg.quantized_kv_start if kv_quant(cfg) else None)
