"""A vision-language model's image side, run by the head: the processor and the
vision tower (``shards/models/tower.py``) on one thread of their own.

Why on the head: the rows an image becomes are no larger than the pixels the
processor makes of it (Qwen2.5-VL: one row of ``hidden_size`` values for four
14x14x3x2 patches), so running the tower on the first stage's node would save no
bytes on the wire; the head holds every sequence's truth already, so a replay, or
a prefill that starts inside an image after cached prefix blocks, sends the rows
again without running the tower, and the first stage stays a plain splice of
rows into its embeddings. The tower's weights (mlx-vlm keeps them at full
precision, as ``mlx_vlm.convert`` does) count against the head's machine: with
local stages, the memory the planner leaves them (``Cluster._pipeline``).

``VisionRunner`` keeps the rows of recent images by their content (``digest``),
within ``cache_bytes``: the same screenshot in a later turn costs no tower run.
Every MLX call (loading included) runs on its one worker thread.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from mlxpipe.server.core.media import ImageRows, Media

logger = logging.getLogger(__name__)

ROWS_CACHE_BYTES = 256 << 20  # images' rows the head keeps by content, at most


PROBE_SIDE = 448  # the probe image's side, in pixels (a gray square, through the model's own processor)


@dataclass
class TowerCost:
    """What the tower costs the head, as planned: its weights from the model folder's headers,
    and the time and memory of an image, in proportion to its placeholder tokens, from one probe
    image run as it starts (which also compiles its kernels)."""

    weight_bytes: int = 0      # the vision unit's tensors, from the safetensors headers
    probe_tokens: int = 0      # the probe image's placeholder tokens
    probe_seconds: float = 0.0
    probe_bytes: int = 0       # MLX's peak over what was in use before, while it ran the probe

    def predict(self, tokens: int) -> Dict[str, float]:
        """An image of ``tokens`` placeholders: seconds, and bytes at the peak (weights included)."""
        share = tokens / max(self.probe_tokens, 1)
        return {"seconds": self.probe_seconds * share, "bytes": self.weight_bytes + int(self.probe_bytes * share)}

    def line(self) -> str:
        return (f"vision tower on the head: {self.weight_bytes / 1e6:.1f} MB of weights; an image of "
                f"{self.probe_tokens} tokens ({PROBE_SIDE}x{PROBE_SIDE} px) {self.probe_seconds * 1e3:.0f} ms, "
                f"{self.probe_bytes / 1e6:.1f} MB more at the peak")


@dataclass
class TowerStats:
    """What the tower cost, measured (``/health``, ``mlxpipe bench vision``)."""

    weight_bytes: int = 0      # its weights, read on the head
    peak_bytes: int = 0        # MLX's peak while it ran an image, over what was in use before (the largest)
    images: int = 0            # images it turned into rows
    seconds: float = 0.0       # ... in all
    last_seconds: float = 0.0
    last_tokens: int = 0
    last_peak_bytes: int = 0
    cache_hits: int = 0        # images whose rows were kept from before

    def to_dict(self) -> dict:
        return {"weight_bytes": self.weight_bytes, "peak_bytes": self.peak_bytes, "images": self.images,
                "seconds": round(self.seconds, 4), "last_seconds": round(self.last_seconds, 4),
                "last_tokens": self.last_tokens, "last_peak_bytes": self.last_peak_bytes,
                "cache_hits": self.cache_hits}


class VisionRunner:
    """The processor and tower of the model at ``path``, on one thread."""

    def __init__(self, path: Path, cache_bytes: int = ROWS_CACHE_BYTES):
        self.path = Path(path)
        self.cache_bytes = cache_bytes
        self.stats = TowerStats()
        self.cost = TowerCost()
        self._rows: "OrderedDict[bytes, ImageRows]" = OrderedDict()
        self._held = 0
        self._lock = threading.Lock()  # the rows cache (the event loop and the worker read it)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vision")
        try:
            self._pool.submit(self._load).result()
        except BaseException:
            self._pool.shutdown(wait=True)
            raise

    def _load(self) -> None:
        from mlxpipe.shards.models.tower import Processor, Tower

        from mlxpipe.shards.models.weights import model_units

        self.processor = Processor(self.path)
        self.tower = Tower(self.path)
        self.stats.weight_bytes = self.tower.bytes
        self.image_token_id = self.tower.image_token_id
        self.multi_axis = self.tower.rope_index is not None
        vision = model_units(self.path).get("vision")
        self.cost.weight_bytes = vision.data_bytes if vision is not None else 0
        self._probe()
        logger.info("%s", self.cost.line())

    def _probe(self) -> None:
        """One gray image through the processor and the tower: what the plan says an image costs."""
        import mlx.core as mx
        from PIL import Image

        image = self.processor.process(Image.new("RGB", (PROBE_SIDE, PROBE_SIDE), (128, 128, 128)))
        self.tower.rows(image)  # compiles the kernels: the timed run is the second
        before = mx.get_active_memory()
        mx.reset_peak_memory()
        _, seconds = self.tower.timed_rows(image)
        self.cost.probe_tokens, self.cost.probe_seconds = image.tokens, seconds
        self.cost.probe_bytes = max(mx.get_peak_memory() - before, 0)

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    # -- the prompt ---------------------------------------------------------------------

    def expand(self, text: str, images: Sequence):
        """``text`` with each image's marker replaced by what its processor makes of it (on the
        worker thread: the processor is not shared between threads)."""
        return self._pool.submit(self.processor.expand, text, images).result()

    async def media(self, ids: Sequence[int], expanded) -> Media:
        """The rows and positions of a prompt whose images ``expanded`` holds (``ids``: its tokens)."""
        return await asyncio.wrap_future(self._pool.submit(self._media, list(ids), expanded.images))

    def _media(self, ids: List[int], images) -> Media:
        at = [i for i, t in enumerate(ids) if t == self.image_token_id]
        rows = [self._image_rows(im) for im in images]
        positions, shift = None, 0
        got = self.tower.positions(ids, images) if self.multi_axis else None
        if got is not None:
            table, shift = got
            positions = table.tolist()
        return Media(at, rows, positions, shift)

    def _image_rows(self, image) -> ImageRows:
        with self._lock:
            kept = self._rows.get(image.digest)
            if kept is not None:
                self._rows.move_to_end(image.digest)
                self.stats.cache_hits += 1
                return kept
        import mlx.core as mx

        from mlxpipe.proto import codec

        before = mx.get_active_memory()
        mx.reset_peak_memory()
        rows, seconds = self.tower.timed_rows(image)
        stats = self.stats
        stats.last_peak_bytes = max(mx.get_peak_memory() - before, 0)
        stats.peak_bytes = max(stats.peak_bytes, stats.last_peak_bytes)
        stats.images += 1
        stats.seconds += seconds
        stats.last_seconds, stats.last_tokens = seconds, image.tokens
        wire = codec.encode(rows)
        out = ImageRows(image.digest, int(rows.shape[0]), wire.data, wire.dtype, int(rows.shape[1]))
        self._keep(out)
        return out

    def _keep(self, rows: ImageRows) -> None:
        with self._lock:
            self._rows[rows.digest] = rows
            self._held += len(rows.data)
            while self._held > self.cache_bytes and len(self._rows) > 1:
                _, old = self._rows.popitem(last=False)
                self._held -= len(old.data)

    @property
    def planned_bytes(self) -> int:
        """What the head holds for images beyond the tower's weights: an image's peak at the probe's
        size, and the rows it keeps (on a machine that also runs stages, their KV cache has less)."""
        return self.cost.probe_bytes + self.cache_bytes

    def report(self) -> Dict[str, object]:
        """The tower as measured, and as planned (``/health``'s ``vision``)."""
        planned = self.cost.predict(self.stats.last_tokens) if self.stats.last_tokens else {}
        return {**self.stats.to_dict(), "rows_cached": len(self._rows), "rows_cached_bytes": self._held,
                "planned": {"weight_bytes": self.cost.weight_bytes, "probe_tokens": self.cost.probe_tokens,
                            "probe_seconds": round(self.cost.probe_seconds, 4),
                            "probe_peak_bytes": self.cost.probe_bytes, "last_image": planned}}


def load_vision(model) -> Optional[VisionRunner]:
    """The head's vision runner for ``model`` (a ``cluster.model.Model``), or None when the
    model takes no images (a text model, or mlx-vlm missing: said once in the log)."""
    if not model.vision:
        if model.tower_note:
            logger.warning("%s", model.tower_note)
        return None
    t0 = time.perf_counter()
    runner = VisionRunner(model.path)
    logger.info("vision tower ready in %.1f s", time.perf_counter() - t0)
    return runner
