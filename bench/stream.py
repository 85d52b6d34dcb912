"""``mlxpipe bench stream``: one stream, mlx-lm ``generate_step`` in its own process vs the
pipeline at 1, 2, 3 stages, decode tokens/s."""

from __future__ import annotations

import argparse
from dataclasses import asdict
from typing import Dict, List

from mlxpipe.bench.common import (DEFAULT_PROMPT, Baseline, RunResult, add_common_arguments, chat_prompt, median,
                                  pipeline_run, progress_bar)
from mlxpipe.server.cluster import Cluster, ClusterConfig
from mlxpipe.shards.store import resolve_model


async def bench_stream(args) -> dict:
    path = str(resolve_model(args.model))
    counts = [int(x) for x in args.stages.split(",")]
    clusters = {}
    baseline = Baseline(path, 0 if args.pin else None)
    try:
        for n in counts:
            clusters[n] = await Cluster(ClusterConfig(model=path, stages=n, pin=args.pin)).start()
        prompt = chat_prompt(clusters[counts[0]].tokenizer, args.prompt)
        series: Dict[str, List[RunResult]] = {"mlx-lm": []}
        series.update({f"{n} stage{'s' if n > 1 else ''}": [] for n in counts})
        bar = progress_bar(args.runs * len(series), "stream")
        for _ in range(args.runs):
            series["mlx-lm"].append(baseline.run(prompt, args.max_tokens))
            for n, name in zip(counts, list(series)[1:]):
                series[name].append(await pipeline_run(clusters[n], prompt, args.max_tokens))
            if bar:
                bar.update(len(series))
        if bar:
            bar.close()
    finally:
        baseline.close()
        for c in clusters.values():
            await c.stop()
    base = median([r.decode_tps for r in series["mlx-lm"]])
    lines = [f"one stream, {len(prompt)} prompt tokens, {args.max_tokens} generated, {args.runs} runs each",
             f"{'':24}{'decode tok/s':>13}{'ratio':>8}{'TTFT s':>9}   runs (decode tok/s)"]
    for name, runs in series.items():
        tps = median([r.decode_tps for r in runs])
        lines.append(f"{name:24}{tps:13.2f}{tps / base:8.3f}{median([r.ttft_s for r in runs]):9.2f}   "
                     + " ".join(f"{r.decode_tps:.2f}" for r in runs))
    print("\n".join(lines))
    return {name: [asdict(r) for r in runs] for name, runs in series.items()}


def add_parser(sub: argparse._SubParsersAction) -> None:
    q = add_common_arguments(sub.add_parser("stream", help="one stream: mlx-lm vs the pipeline at 1, 2, 3 stages"))
    q.add_argument("--stages", default="1,2,3", help="stage counts to measure")
    q.add_argument("--max-tokens", type=int, default=64)
    q.add_argument("--prompt", default=DEFAULT_PROMPT)
    q.set_defaults(measure=bench_stream)
