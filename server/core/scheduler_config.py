"""The scheduler's parameters (``scheduler.py``), apart so that the config tree
(``server/config.py``) takes them without the scheduler's logic."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass
class SchedulerConfig:
    """The scheduler's parameters, derived from the config tree (``server/config.py``)
    by ``cluster/sizing.py``'s ``scheduler_config``; the defaults here are a plain scheduler's, for direct use."""

    num_groups: int = 2            # micro-batch groups in flight
    max_batch: int = 32            # sequences per group
    chunk_size: int = 256          # prefill tokens per step, at most
    min_chunk: int = 16            # smallest chunk a short prefill is cut into
    max_stall: float = 0.2         # seconds a prefill chunk may hold a stage (0: no bound)
    max_prefill_inflight: int = 2  # prefill steps in flight
    max_overtaken: int = 8         # prefill steps others may take ahead of the oldest prompt in a row (0: FIFO)
    batch_share: int = 4           # interactive admissions or prefill steps in a row while batch waits, at most
    batch_reserve: int = 1         # running places batch-class sequences leave free for interactive ones
    max_running: Optional[int] = None  # sequences holding caches (None: num_groups x max_batch)
    max_waiting: int = 256         # requests queued before QueueFull
    max_kv_tokens: int = 1 << 62   # KV-cache positions all admitted sequences and cached blocks may take
    block_tokens: int = 16         # positions per prefix-cache block
    prefix_blocks: int = 0         # blocks every stage may keep for the prefix cache (0: no prefix cache)
    prefix_disk_blocks: int = 0    # ... and on its disk (0: no disk tier)
    speculate: bool = False        # verify drafted tokens while few sequences are live
    spec_max_running: int = 2      # ... at most this many
    spec_positions: int = 1        # positions per VERIFY step (1 where extra rows cost in proportion)
    spec_depth: int = 8            # positions beyond the confirmed in flight, at most (adapted per sequence)
    spec_frames: int = 2           # VERIFY steps in flight per sequence, at most (a step more than the stages
                                   # would only queue at stage 0, and be lost on a miss)
    kv_start: Optional[int] = None  # KV quantization asked for: mlx-lm's quantized_kv_start (None: none)
