"""``mlxpipe bench load``: concurrent streaming clients through the HTTP API, ``mlxpipe
serve`` vs ``mlx_lm.server`` (its own continuous batching) at each concurrency
level: time to first token (p50, p95), per-stream and aggregate decode tokens/s,
each stage's busy fraction; JSON and a PNG chart."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import List

import httpx
from mlx_lm.utils import load_tokenizer

from mlxpipe.bench.common import (Baseline, HttpServer, RunResult, add_common_arguments, chat_prompt, decode_rate,
                                  decode_window, long_text, measured_mix, median, percentile, pin_flags,
                                  progress_bar, window_rate, window_tokens)
from mlxpipe.server.config import ClusterConfig
from mlxpipe.shards.models.store import resolve_model


@dataclass
class LoadRound:
    server: str
    concurrency: int
    ttft_s: List[float]
    stream_tps: List[float]
    aggregate_tps: float
    busy: List[float] = field(default_factory=list)  # per stage, over the decode window
    server_cpu_per_1k: float = float("nan")  # CPU seconds of the server process per 1,000 tokens
    window_tokens: int = 0  # tokens the aggregate counts: those while every stream decodes (``decode_window``)


async def _stage_busy_sampler(http, url: str, samples: list, stop: asyncio.Event) -> None:
    while not stop.is_set():
        try:
            h = (await http.get(f"{url}/health", timeout=10)).json()
            samples.append((time.monotonic(), [s.get("busy_seconds", 0.0) for s in h["stages"]]))
        except Exception:  # noqa: BLE001 - a missed sample only widens the estimate
            pass
        await asyncio.sleep(0.5)


def _busy_between(samples: list, lo: float, hi: float) -> List[float]:
    inside = [s for s in samples if lo <= s[0] <= hi]
    if len(inside) < 2:
        return []
    (t0, b0), (t1, b1) = inside[0], inside[-1]
    return [(y - x) / (t1 - t0) for x, y in zip(b0, b1)]


async def load_round(server: HttpServer, model: str, prompts: List[str], max_tokens: int,
                     eos: List[int], sample_busy: bool) -> LoadRound:
    async def one(http, text):
        body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
                "temperature": 0, "stream": True, "logit_bias": {str(e): -100 for e in eos}}
        t0 = time.monotonic()
        times = []
        async with http.stream("POST", f"{server.url}/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                raise RuntimeError(f"{server.name}: HTTP {resp.status_code}: {await resp.aread()}")
            async for line in resp.aiter_lines():
                if line.startswith("data: {"):
                    choices = json.loads(line[6:]).get("choices") or [{}]
                    if (choices[0].get("delta") or {}).get("content"):
                        times.append(time.monotonic())
        return t0, times

    samples: list = []
    stop = asyncio.Event()
    limits = httpx.Limits(max_connections=len(prompts) + 4)
    cpu0 = server.cpu_seconds()
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        sampler = asyncio.ensure_future(_stage_busy_sampler(http, server.url, samples, stop)) if sample_busy else None
        results = await asyncio.gather(*(one(http, p) for p in prompts))
        stop.set()
        if sampler:
            await sampler
    # (the busy sampler's /health calls are in it: two a second, a small share)
    cpu = server.cpu_seconds() - cpu0
    all_times = [ts for _, ts in results]
    window = decode_window(all_times)
    return LoadRound(server.name, len(prompts), [ts[0] - t0 for t0, ts in results if ts],
                     [decode_rate(ts) for ts in all_times], window_rate(all_times),
                     _busy_between(samples, *window) if sample_busy and window else [],
                     1000 * cpu / (max_tokens * len(prompts)), window_tokens(all_times))


async def bench_load(args) -> dict:
    path = str(resolve_model(args.model))
    tok = load_tokenizer(path)
    levels = [int(x) for x in args.concurrency.split(",")]
    servers: List[HttpServer] = []
    baseline = None
    try:
        if args.url:
            ours = HttpServer.running("mlxpipe", args.url)
        else:
            cmd = [sys.executable, "-m", "mlxpipe.server.cli", "serve", "--port", "0", "--model", path,
                   "--stages", str(args.stages), "--max-tokens", str(args.max_tokens)]
            cmd += pin_flags(args.pin)
            ours = HttpServer("mlxpipe", cmd + shlex.split(args.serve_args))
            servers.append(ours)
        stages = len(httpx.get(f"{ours.url}/health", timeout=30).json()["stages"])  # what it runs (--url: any count)
        theirs = HttpServer.mlx_lm(path, args.pin)
        servers.append(theirs)
        baseline = Baseline(path, 0 if args.pin else None)
        eos = sorted(tok.eos_token_ids)
        rounds: List[LoadRound] = []
        single: List[RunResult] = []
        bar = progress_bar(args.runs * (2 * len(levels) + 1), "load")
        for r in range(args.runs):
            single.append(baseline.run(chat_prompt(tok, long_text(tok, args.prompt_tokens, f"s{r}")),
                                       args.max_tokens))
            if bar:
                bar.update()
            for c in levels:
                for server in (ours, theirs):
                    prompts = [long_text(tok, args.prompt_tokens, f"{server.name}-{r}-{c}-{i}")
                               for i in range(c)]
                    rounds.append(await load_round(server, "default" if server is ours else path, prompts,
                                                   args.max_tokens, eos, sample_busy=server is ours))
                    if bar:
                        bar.update()
        if bar:
            bar.close()
        mix = measured_mix(ours.url)
    finally:
        if baseline:
            baseline.close()
        for s in servers:
            s.close()

    def agg(name, c, attr):
        return [getattr(x, attr) for x in rounds if x.server == name and x.concurrency == c]

    table = []
    single_tps = median([s.decode_tps for s in single])
    lines = [f"{args.prompt_tokens}-token prompts, {args.max_tokens} tokens each, {args.runs} runs per level; "
             f"mlx-lm generate (1 process, 1 stream): {single_tps:.2f} decode tok/s",
             f"{'server':15}{'streams':>8}{'TTFT p50':>10}{'TTFT p95':>10}{'stream tok/s':>14}"
             f"{'aggregate tok/s':>17}{'vs mlx_lm.server':>18}{'CPU s/1k tok':>13}   stage busy"]
    for c in levels:
        base = median(agg("mlx_lm.server", c, "aggregate_tps"))
        for name in ("mlxpipe", "mlx_lm.server"):
            ttft = [t for xs in agg(name, c, "ttft_s") for t in xs]
            stream = [t for xs in agg(name, c, "stream_tps") for t in xs]
            aggregate = median(agg(name, c, "aggregate_tps"))
            busy_runs = [b for b in agg(name, c, "busy") if b]
            busy = [median(col) for col in zip(*busy_runs)] if busy_runs else []
            cpu = median(agg(name, c, "server_cpu_per_1k"))
            row = {"server": name, "concurrency": c, "ttft_p50": percentile(ttft, 0.5),
                   "ttft_p95": percentile(ttft, 0.95), "stream_tps": median(stream), "aggregate_tps": aggregate,
                   "ratio_vs_mlx_lm_server": aggregate / base, "server_cpu_s_per_1k_tokens": cpu,
                   "stage_busy": busy}
            table.append(row)
            lines.append(f"{name:15}{c:8d}{row['ttft_p50']:10.2f}{row['ttft_p95']:10.2f}{row['stream_tps']:14.2f}"
                         f"{aggregate:17.2f}{aggregate / base:18.2f}{cpu:13.1f}   "
                         + " ".join(f"{b:.0%}" for b in busy))
    lines.append(f"one stream vs mlx-lm generate: {median(agg('mlxpipe', levels[0], 'aggregate_tps')) / single_tps:.3f}"
                 if levels[0] == 1 else "")
    print("\n".join(line for line in lines + mix if line))
    result = {"stages": stages, "levels": table, "mlx_lm_generate_decode_tps": single_tps, "measured_mix": mix,
              "rounds": [asdict(r) for r in rounds], "single": [asdict(s) for s in single]}
    if args.chart:
        chart(result, args.chart)
        print(f"chart: {args.chart}")
    return result


def chart(result: dict, path: str) -> None:
    """Aggregate decode tokens/s against concurrency, ours beside the baselines."""
    try:  # optional: pip install -e '.[bench]'
        import matplotlib
    except ImportError:
        print("no chart: matplotlib is not installed (pip install -e '.[bench]')", file=sys.stderr)
        return
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, style in (("mlxpipe", "o-"), ("mlx_lm.server", "s--")):
        rows = [r for r in result["levels"] if r["server"] == name]
        ax.plot([r["concurrency"] for r in rows], [r["aggregate_tps"] for r in rows], style, label=name)
    ax.axhline(result["mlx_lm_generate_decode_tps"], color="gray", linestyle=":",
               label="mlx-lm generate, one stream")
    ax.set_xscale("log", base=2)
    levels = sorted({r["concurrency"] for r in result["levels"]})
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("aggregate decode tokens/s (median)")
    ax.set_title(f"mlxpipe ({result['stages']} stages) vs mlx_lm.server, same model")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def add_parser(sub: argparse._SubParsersAction) -> None:
    q = add_common_arguments(sub.add_parser("load"))
    q.add_argument("--stages", type=int, default=ClusterConfig.stages,
                   help="local stage processes (default %(default)s)")
    q.add_argument("--concurrency", default="1,2,4,8", help="concurrency levels")
    q.add_argument("--prompt-tokens", type=int, default=64, help="tokens per prompt (default %(default)s)")
    q.add_argument("--max-tokens", type=int, default=48, help="tokens per answer (default %(default)s)")
    q.add_argument("--url", default=None, help="drive this running mlxpipe server instead of starting one")
    q.add_argument("--serve-args", default="",
                   help="more options for the mlxpipe serve it starts, e.g. '--no-speculate'")
    q.add_argument("--chart", default="bench-out/load.png", help="PNG chart to write ('' for none)")
    q.set_defaults(measure=bench_load)
