"""``mlxpipe bench fairness``: does a long prompt hold the others back? A short
request's time to first token (the probe) on an idle server and while 1 and 4
long prompts prefill, and the long prompts' own time to first token beside that
of one alone; ``mlxpipe serve`` beside ``mlx_lm.server`` on the same weights,
both up and measured in turn."""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Dict, List

import httpx
from mlx_lm.utils import load_tokenizer

from mlxpipe.bench.common import HttpServer, add_common_arguments, long_text, median, pin_flags
from mlxpipe.server.config import ClusterConfig
from mlxpipe.shards.models.store import resolve_model


@dataclass
class Round:
    server: str
    longs: int                  # long prompts prefilling (0: the server is idle)
    probe_s: List[float]        # each probe's time to first token
    long_s: List[float] = field(default_factory=list)  # each long prompt's time to first token


async def first_token(http: httpx.AsyncClient, url: str, model: str, text: str) -> float:
    """Seconds from sending ``text`` (one token asked) to its first streamed token."""
    body = {"model": model, "prompt": text, "max_tokens": 1, "temperature": 0, "stream": True}
    t0 = time.monotonic()
    async with http.stream("POST", f"{url}/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if line.startswith("data: {") and json.loads(line[6:]).get("choices"):
                return time.monotonic() - t0
    raise RuntimeError(f"{url}: the stream ended without a token")


async def measure_round(http, server: HttpServer, model: str, tok, args, longs: int, tag: str,
                        probe_after: float) -> Round:
    """``longs`` long prompts sent at once; after ``probe_after`` seconds, probes one after
    another (``args.probes``) while any of them is still waiting for its first token."""
    if not longs:
        probes = [await first_token(http, server.url, model, long_text(tok, args.probe_tokens, f"{tag}-p{i}"))
                  for i in range(args.probes)]
        return Round(server.name, 0, probes)
    tasks = [asyncio.ensure_future(first_token(http, server.url, model, long_text(tok, args.long_tokens,
                                                                                     f"{tag}-l{i}")))
             for i in range(longs)]
    await asyncio.sleep(probe_after)
    probes = []
    for i in range(args.probes):
        if all(t.done() for t in tasks):
            break
        probes.append(await first_token(http, server.url, model, long_text(tok, args.probe_tokens, f"{tag}-p{i}")))
    return Round(server.name, longs, probes, list(await asyncio.gather(*tasks)))


async def bench_fairness(args) -> dict:
    path = str(resolve_model(args.model))
    tok = load_tokenizer(path)
    levels = [int(x) for x in args.longs.split(",")]
    servers: List[HttpServer] = []
    try:
        if args.url:
            ours = HttpServer.running("mlxpipe", args.url)
        else:
            cmd = [sys.executable, "-m", "mlxpipe.server.cli", "serve", "--port", "0", "--model", path,
                   "--stages", str(args.stages)] + pin_flags(args.pin)
            ours = HttpServer("mlxpipe", cmd + shlex.split(args.serve_args))
        servers.append(ours)
        stages = len(httpx.get(f"{ours.url}/health", timeout=30).json()["stages"])
        if args.baseline:
            servers.append(HttpServer.mlx_lm(path, args.pin))
        rounds: List[Round] = []
        alone: Dict[str, List[float]] = {s.name: [] for s in servers}
        limits = httpx.Limits(max_connections=max(levels) + 8)
        async with httpx.AsyncClient(timeout=args.timeout, limits=limits) as http:
            for server in servers:  # warm: kernels compiled, a prefill step timed
                model = "default" if server is ours else path
                await first_token(http, server.url, model, long_text(tok, args.probe_tokens, f"{server.name}-warm"))
            for r in range(args.runs):
                for server in servers:
                    model = "default" if server is ours else path
                    tag = f"{server.name}-{r}"
                    rounds.append(await measure_round(http, server, model, tok, args, 0, tag, 0.0))
                    alone[server.name].append(await first_token(http, server.url, model,
                                                                long_text(tok, args.long_tokens, f"{tag}-alone")))
                    after = args.probe_after * alone[server.name][-1]
                    for k in levels:
                        rounds.append(await measure_round(http, server, model, tok, args, k, f"{tag}-{k}", after))
                    print(f"run {r + 1}/{args.runs}, {server.name}: done", file=sys.stderr)
    finally:
        for s in servers:
            s.close()
    return report(args, stages, levels, rounds, alone)


def report(args, stages: int, levels: List[int], rounds: List[Round], alone: Dict[str, List[float]]) -> dict:
    rows = []
    lines = [f"a {args.probe_tokens}-token probe's time to first token while {args.long_tokens}-token prompts "
             f"prefill ({stages} stages, {args.runs} run(s), medians; probes start {args.probe_after:.0%} into "
             f"a long prompt's time alone)",
             f"{'server':15}{'long prompts':>13}{'probes':>7}{'probe TTFT s':>14}{'vs idle':>9}{'worst':>8}"
             f"{'long TTFT s':>13}{'vs alone':>10}"]
    for name in alone:
        idle = median([p for x in rounds if x.server == name and x.longs == 0 for p in x.probe_s])
        lone = median(alone[name])
        rows.append({"server": name, "longs": 0, "probe_s": idle, "vs_idle": 1.0, "long_s": lone, "vs_alone": 1.0})
        lines.append(f"{name:15}{'0 (idle)':>13}{args.probes * args.runs:7d}{idle:14.2f}{1.0:9.2f}{'':8}"
                     f"{lone:13.2f}{'(alone)':>10}")
        for k in levels:
            mine = [x for x in rounds if x.server == name and x.longs == k]
            probes = [p for x in mine for p in x.probe_s]
            longs = [t for x in mine for t in x.long_s]
            probe = median(probes)
            # With k prompts at once the first finishes as if alone (or not): compare the first.
            first = median([min(x.long_s) for x in mine])
            row = {"server": name, "longs": k, "probes": len(probes), "probe_s": probe, "vs_idle": probe / idle,
                   "worst_vs_idle": max(probes, default=float("nan")) / idle, "long_s": median(longs),
                   "first_long_s": first, "vs_alone": first / lone}
            rows.append(row)
            lines.append(f"{name:15}{k:13d}{len(probes):7d}{probe:14.2f}{probe / idle:9.2f}"
                         f"{row['worst_vs_idle']:8.2f}{first:13.2f}{first / lone:10.2f}")
    lines.append("(long TTFT: the first of the long prompts to get its first token; vs alone: against one "
                 "long prompt alone on the same server)")
    print("\n".join(lines))
    return {"stages": stages, "long_tokens": args.long_tokens, "probe_tokens": args.probe_tokens, "rows": rows,
            "alone": alone, "rounds": [asdict(r) for r in rounds]}


def add_parser(sub: argparse._SubParsersAction) -> None:
    q = add_common_arguments(sub.add_parser("fairness"))
    q.set_defaults(runs=1)
    q.add_argument("--stages", type=int, default=ClusterConfig.stages, help="local stage processes (default %(default)s)")
    q.add_argument("--long-tokens", type=int, default=8000, help="tokens per long prompt (default %(default)s)")
    q.add_argument("--probe-tokens", type=int, default=20, help="tokens per probe (default %(default)s)")
    q.add_argument("--longs", default="1,4", help="long prompts at once, per level (default %(default)s)")
    q.add_argument("--probes", type=int, default=3, help="probes per level, one after another (default %(default)s)")
    q.add_argument("--probe-after", type=float, default=0.1,
                   help="probes start this share of a long prompt's time alone after the long prompts are sent "
                        "(default %(default)s)")
    q.add_argument("--baseline", action=argparse.BooleanOptionalAction, default=True,
                   help="also measure mlx_lm.server on the same weights (--no-baseline: not)")
    q.add_argument("--timeout", type=float, default=7200, help="seconds a request may take (default %(default)s)")
    q.add_argument("--url", default=None, help="drive this running mlxpipe server instead of starting one")
    q.add_argument("--serve-args", default="",
                   help="more options for the mlxpipe serve it starts, e.g. '--max-stall 0'")
    q.set_defaults(measure=bench_fairness)
