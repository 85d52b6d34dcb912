"""The one platform boundary: what a stage does on Apple silicon that mlx-lm does for a whole model.

macOS lets the GPU wire (keep resident, never paged) up to its recommended
working set (``max_recommended_working_set_size``, about 75% of RAM; raised
with ``sudo sysctl iogpu.wired_limit_mb``: docs/multi-mac.md). mlx-lm, for a
whole model, sets MLX's wired limit to it while generating and warns when the
model is close to it (``wired_limit`` in ``mlx_lm/generate.py``,
``maybe_set_recommended_wired_limit``). A stage does the same for its shard,
once loaded (``Metal.settle``, on the MLX thread):

- wired limit: the recommended working set, so macOS does not page the
  shard's weights and caches out under pressure; the previous limit comes
  back at exit (and when ``restore`` is called);
- cache limit: MLX keeps freed buffers for reuse, by default up to its memory
  limit; a stage keeps at most what the working set leaves beside its weights
  and KV budget (at least ``MIN_CACHE``), so reuse never crowds them out;
- a warning, in the node's log and in Load's reply (``mlxpipe status`` shows
  it), when weights + KV budget pass 90% of the working set (mlx-lm's rule).

And what a node offers by default (``profile.offered_memory``: the planner's
budget, the head's KV caps, a stage's own) stays under that 90% (``budget``).

Without Metal (Linux, CPU) every call here is a no-op. Tests drive it with a
fake of the few MLX calls it makes (``MlxCalls``).
"""

from __future__ import annotations

import atexit
import logging
from typing import Optional

from mlxpipe.shards.params.sizes import gb

logger = logging.getLogger(__name__)

CLOSE = 0.9             # of the recommended working set: mlx-lm warns above it
MIN_CACHE = 256 << 20   # MLX's buffer cache is never capped below this


class MlxCalls:
    """The MLX calls this boundary makes (a fake stands in for it in tests)."""

    def metal_available(self) -> bool:
        import mlx.core as mx

        return mx.metal.is_available()

    def device_info(self) -> dict:
        import mlx.core as mx

        return mx.device_info() if hasattr(mx, "device_info") else mx.metal.device_info()

    def set_wired_limit(self, n: int) -> int:
        import mlx.core as mx

        return mx.set_wired_limit(n)

    def set_cache_limit(self, n: int) -> int:
        import mlx.core as mx

        return mx.set_cache_limit(n)

    def synchronize(self) -> None:
        import mlx.core as mx

        mx.synchronize()


class Metal:
    """Wired memory, cache limit and working-set warnings of one stage process."""

    def __init__(self, calls: Optional[MlxCalls] = None, at_exit=atexit.register):
        self.calls = calls or MlxCalls()
        self.available = self.calls.metal_available()
        self._at_exit = at_exit
        self._old_wired: Optional[int] = None
        self._old_cache: Optional[int] = None

    def working_set(self) -> Optional[int]:
        """Bytes the GPU may wire (None without Metal)."""
        if not self.available:
            return None
        return self.calls.device_info().get("max_recommended_working_set_size")

    def budget(self, offered: int) -> int:
        """The default memory a node offers: ``offered``, but under ``CLOSE`` of the
        working set on Metal."""
        ws = self.working_set()
        return offered if ws is None else min(offered, int(CLOSE * ws))

    def settle(self, weight_bytes: int, kv_bytes: int, what: str) -> str:
        """After a shard is loaded: wire, cap the cache; return the warning ('' if none)."""
        ws = self.working_set()
        if ws is None:
            return ""
        if self._old_wired is None:
            self._old_wired = self.calls.set_wired_limit(ws)
            self._at_exit(self.restore)
        old_cache = self.calls.set_cache_limit(max(ws - weight_bytes - kv_bytes, MIN_CACHE))
        if self._old_cache is None:
            self._old_cache = old_cache
        if weight_bytes + kv_bytes <= CLOSE * ws:
            return ""
        warning = (f"{what}: {gb(weight_bytes)} of weights + {gb(kv_bytes)} of KV budget is close to the "
                   f"{gb(ws)} this Mac's GPU may wire (its recommended working set): macOS may page it out and "
                   "decoding slows sharply. Raise the limit (sudo sysctl iogpu.wired_limit_mb=..., "
                   "docs/multi-mac.md), or give this node fewer layers or a smaller --memory")
        logger.warning(warning)
        return warning

    def restore(self) -> None:
        """Put back the wired and cache limits found before ``settle`` (after the work in
        flight: the wired limit must not change under an evaluation, as mlx-lm notes)."""
        if self._old_wired is not None or self._old_cache is not None:
            self.calls.synchronize()
        if self._old_wired is not None:
            self.calls.set_wired_limit(self._old_wired)
            self._old_wired = None
        if self._old_cache is not None:
            self.calls.set_cache_limit(self._old_cache)
            self._old_cache = None
