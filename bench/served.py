"""``mlxpipe bench served``: one stream through ``mlxpipe serve`` as a user starts it
(its default placement and speculation) beside ``mlx_lm.server`` on the same
weights, in the same run: a copy-from-prompt task (a parts list to return
unchanged, what agents and editors ask for) and a plain chat prompt, each with
speculation as served (``auto``) and off (``"speculation": "none"`` on the
request), greedy; decode tokens/s after the first token (medians), texts checked
identical."""

from __future__ import annotations

import argparse
import shlex
import sys
from typing import Dict, List, Tuple

import httpx

from mlxpipe.bench.common import (DEFAULT_PROMPT, HttpServer, add_common_arguments, measured_mix, median,
                                  pin_flags, progress_bar, stream_chat)
from mlxpipe.server.config import ClusterConfig
from mlxpipe.shards.models.store import resolve_model

PARTS = "\n".join(f"{i + 1}. {name}: {qty} x part {1000 + 37 * i}" for i, (name, qty) in enumerate([
    ("hex bolt M6x20", 40), ("washer M6", 80), ("lock nut M6", 40), ("aluminium bracket", 8),
    ("steel hinge", 4), ("rubber foot", 4), ("cable tie 200 mm", 50), ("DIN rail 35 mm", 2),
    ("terminal block", 24), ("fuse holder", 6), ("fuse 5 A", 12), ("power switch", 1),
    ("cable gland PG9", 6), ("enclosure 300x200", 1)]))
COPY_PROMPT = f"Here is a parts list:\n\n{PARTS}\n\nCopy the parts list exactly as it is, line by line, nothing else."


async def _one(http: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int,
               speculation: str = "") -> Tuple[float, str, int]:
    """Decode tokens/s after the first token, the text, the tokens counted."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0}
    if speculation:
        body["speculation"] = speculation
    times, text, usage = await stream_chat(http, url, body)
    tokens = usage.get("completion_tokens") or 0
    span = times[-1] - times[0] if len(times) > 1 else float("nan")
    return (tokens - 1) / span if span > 0 else float("nan"), text, tokens


async def bench_served(args) -> dict:
    path = str(resolve_model(args.model))
    prompts = {"copy the parts list": COPY_PROMPT, "chat": args.prompt}
    configs = [("mlx_lm.server", ""), ("mlxpipe serve", ""), ("mlxpipe serve, speculation off", "none")]
    servers: List[HttpServer] = []
    series: Dict[str, Dict[str, list]] = {p: {name: [] for name, _ in configs} for p in prompts}
    try:
        ours = HttpServer("mlxpipe", [sys.executable, "-m", "mlxpipe.server.cli", "serve", "--port", "0",
                                      "--model", path, "--stages", str(args.stages)] + pin_flags(args.pin)
                            + shlex.split(args.serve_args))
        servers.append(ours)
        theirs = HttpServer.mlx_lm(path, args.pin)
        servers.append(theirs)
        where = {"mlx_lm.server": (theirs.url, path), "mlxpipe serve": (ours.url, "default"),
                 "mlxpipe serve, speculation off": (ours.url, "default")}
        bar = progress_bar(args.runs * len(prompts) * len(configs), "served")
        async with httpx.AsyncClient(timeout=1200) as http:
            for p in prompts.values():  # warm both: first requests compile kernels
                for url, model in {where[n] for n, _ in configs}:
                    await _one(http, url, model, p, 4)
            for _ in range(args.runs):
                for p, prompt in prompts.items():
                    for name, spec in configs:
                        url, model = where[name]
                        series[p][name].append(await _one(http, url, model, prompt, args.max_tokens, spec))
                        if bar:
                            bar.update(1)
        if bar:
            bar.close()
        mix = measured_mix(ours.url)
    finally:
        for s in servers:
            s.close()
    out = _report(args, series)
    print("\n".join(mix))
    return dict(out, measured_mix=mix)


def _report(args, series: Dict[str, Dict[str, list]]) -> dict:
    extra = " ".join(pin_flags(args.pin) + shlex.split(args.serve_args)) or "default placement"
    lines = [f"one stream through `mlxpipe serve --stages {args.stages}` ({extra})"
             f" and mlx_lm.server, {args.max_tokens} tokens at most, greedy, {args.runs} runs; decode tok/s (medians)"]
    out = {}
    for p, runs in series.items():
        base = median([r[0] for r in runs["mlx_lm.server"]])
        reference = runs["mlx_lm.server"][0][1]
        lines.append(f"{p} ({runs['mlx_lm.server'][0][2]} tokens):")
        out[p] = {}
        for name, rs in runs.items():
            tps = median([r[0] for r in rs])
            same = all(r[1] == reference for r in rs)
            lines.append(f"  {name:34}{tps:8.2f} tok/s {tps / base:7.3f}x   text "
                         f"{'identical to mlx_lm.server' if same else 'DIFFERS from mlx_lm.server'}")
            out[p][name] = {"tok_s": [r[0] for r in rs], "median": tps, "ratio": tps / base, "identical": same}
    print("\n".join(lines))
    return out


def add_parser(sub: argparse._SubParsersAction) -> None:
    q = add_common_arguments(sub.add_parser("served"))
    q.add_argument("--stages", type=int, default=ClusterConfig.stages,
                   help="local stage processes (default %(default)s)")
    q.add_argument("--max-tokens", type=int, default=400, help="tokens per answer, at most (default %(default)s)")
    q.add_argument("--prompt", default=DEFAULT_PROMPT, help="the chat prompt (a user message)")
    q.add_argument("--serve-args", default="",
                   help="more options for the mlxpipe serve it starts, e.g. '--prompt-ratio 0'")
    q.set_defaults(measure=bench_served)
