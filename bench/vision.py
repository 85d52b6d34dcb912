"""``mlxpipe bench vision``: time to first token for one image and a question, through
``mlxpipe serve`` (2 stages by default) and through mlx-vlm in one process on the same
weights, side by side in one run; and the head's vision tower, as planned and as measured.

Each run sends a new image (so neither the head's rows nor the prefix cache have it),
as a PNG data URL to the server and as the same PNG's bytes to mlx-vlm (which decodes,
processes, runs its tower and prefills in ``generate_step``); then the same image again
to the server (its rows kept, its blocks cached). Greedy; the texts are compared. The
tower's figures come from the server's ``/health`` (``vision``): the plan's (weights
from the headers, an image's time and memory in proportion to its tokens from the
probe image the head runs as it starts) beside the last image's, measured.
Without ``--model``, a tiny random-weight Qwen2.5-VL is built for the run (``tiny_vision.py``),
to check the mode itself; timed figures need a real model and a quiet machine.
"""

from __future__ import annotations

import argparse
import base64
import io
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List

import httpx
import numpy as np

from mlxpipe.bench.common import HttpServer, add_common_arguments, median, pin_flags, progress_bar, stream_chat
from mlxpipe.server.config import ClusterConfig

QUESTION = "Describe this image in one sentence."


def _png(seed: int, width: int, height: int) -> bytes:
    """A PNG of smooth random colour (something between noise and a photo)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    small = rng.integers(0, 255, (max(height // 16, 1), max(width // 16, 1), 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(small).resize((width, height), Image.BILINEAR).save(buf, "PNG")
    return buf.getvalue()


class _Mlxvlm:
    """mlx-vlm in this process: the baseline."""

    def __init__(self, path: str):
        from mlx_vlm import load

        self.model, self.processor = load(path)

    def run(self, png: bytes, max_tokens: int) -> tuple:
        """Seconds to the first token, the text (from the PNG's bytes, as a server gets them)."""
        from mlx_vlm.generate.ar import generate_step
        from mlx_vlm.utils import load_image, prepare_inputs

        t0 = time.monotonic()
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
        text = self.processor.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        inputs = prepare_inputs(self.processor, images=[load_image(io.BytesIO(png))], prompts=[text])
        extra = {k: v for k, v in inputs.items() if k not in ("input_ids", "pixel_values", "attention_mask")}
        tokens, first = [], None
        for (token, _), _ in zip(generate_step(inputs["input_ids"], self.model, inputs["pixel_values"],
                                               inputs.get("attention_mask"), temperature=0.0, **extra),
                                 range(max_tokens)):
            first = first or time.monotonic() - t0
            tokens.append(token)
        return first, self.processor.tokenizer.decode(tokens)


async def _served(http: httpx.AsyncClient, url: str, png: bytes, max_tokens: int) -> tuple:
    body = {"model": "default", "max_tokens": max_tokens, "temperature": 0, "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(png).decode()}},
        {"type": "text", "text": QUESTION}]}]}
    t0 = time.monotonic()
    times, text, usage = await stream_chat(http, url, body)
    return (times[0] - t0 if times else float("nan")), text, usage


async def bench_vision(args) -> dict:
    path = args.model
    if path is None:
        from mlxpipe.bench.tiny_vision import build
        from mlxpipe.shards.models.store import default_model_dir

        path = str(build("qwen2_5_vl", Path(tempfile.mkdtemp(prefix="mlxpipe-vision-")) / "qwen2_5_vl",
                         default_model_dir()))
    width, height = (int(x) for x in args.image.lower().split("x"))
    server = HttpServer("mlxpipe", [sys.executable, "-m", "mlxpipe.server.cli", "serve", "--port", "0", "--model",
                                    path, "--stages", str(args.stages)] + pin_flags(args.pin)
                        + shlex.split(args.serve_args))
    series: Dict[str, List[tuple]] = {"mlx-vlm, one process": [], "mlxpipe serve, a new image": [],
                                      "mlxpipe serve, the same image again": []}
    towers = []
    try:
        baseline = _Mlxvlm(path)
        bar = progress_bar(args.runs * 3, "vision")
        async with httpx.AsyncClient(timeout=1200) as http:
            warm = _png(10_000, width, height)  # both compile their kernels first
            await _served(http, server.url, warm, 2)
            baseline.run(warm, 2)
            for i in range(args.runs):
                png = _png(i, width, height)
                series["mlxpipe serve, a new image"].append(await _served(http, server.url, png, args.max_tokens))
                towers.append(httpx.get(f"{server.url}/health", timeout=30).json().get("vision") or {})
                series["mlxpipe serve, the same image again"].append(
                    await _served(http, server.url, png, args.max_tokens))
                series["mlx-vlm, one process"].append(baseline.run(png, args.max_tokens))
                if bar:
                    bar.update(3)
        if bar:
            bar.close()
    finally:
        server.close()
    return _report(args, path, series, towers)


def _report(args, path: str, series: Dict[str, List[tuple]], towers: List[dict]) -> dict:
    base = median([r[0] for r in series["mlx-vlm, one process"]])
    reference = [r[1] for r in series["mlx-vlm, one process"]]
    lines = [f"time to first token, one {args.image} image and a question, greedy, {args.runs} runs (medians): "
             f"{Path(path).name} through `mlxpipe serve --stages {args.stages}` and mlx-vlm in one process"]
    out: dict = {"model": path, "image": args.image, "stages": args.stages, "runs": args.runs}
    for name, runs in series.items():
        ttft = median([r[0] for r in runs])
        same = [r[1] for r in runs] == reference
        lines.append(f"  {name:38}{ttft * 1e3:9.1f} ms {ttft / base:7.3f}x   text "
                     f"{'identical to mlx-vlm' if same else 'DIFFERS from mlx-vlm'}")
        out[name] = {"ttft_s": [r[0] for r in runs], "median_s": ttft, "ratio": ttft / base, "identical": same}
    last = towers[-1] if towers else {}
    planned = (last.get("planned") or {})
    if last:
        lines.append(f"vision tower on the head: weights {last['weight_bytes'] / 1e6:.1f} MB read "
                     f"(planned from the headers: {planned.get('weight_bytes', 0) / 1e6:.1f} MB)")
        measured_s = median([t.get("last_seconds", float("nan")) for t in towers])
        peaks = median([t.get("last_peak_bytes", 0) for t in towers])
        image = planned.get("last_image") or {}
        lines.append(f"  an image of {last.get('last_tokens')} tokens: {measured_s * 1e3:.1f} ms and "
                     f"{(last['weight_bytes'] + peaks) / 1e6:.1f} MB at the peak, measured; planned "
                     f"{image.get('seconds', float('nan')) * 1e3:.1f} ms and {image.get('bytes', 0) / 1e6:.1f} MB "
                     f"(from the {planned.get('probe_tokens')}-token probe image at start)")
        out["tower"] = {"measured": towers, "planned": planned}
    print("\n".join(lines))
    return out


def add_parser(sub: argparse._SubParsersAction) -> None:
    q = add_common_arguments(sub.add_parser("vision"))
    q.set_defaults(model=None)  # a tiny Qwen2.5-VL built for the run
    q.add_argument("--stages", type=int, default=ClusterConfig.stages, help="local stage processes (default %(default)s)")
    q.add_argument("--image", default="448x448", help="the image's size, WIDTHxHEIGHT (default %(default)s)")
    q.add_argument("--max-tokens", type=int, default=8, help="tokens per answer (default %(default)s)")
    q.add_argument("--serve-args", default="", help="more options for the mlxpipe serve it starts")
    q.set_defaults(measure=bench_vision)
