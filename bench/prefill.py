"""``mlxpipe bench prefill``: time to first token of a long prompt, chunked prefill vs not."""

from __future__ import annotations

import argparse
from typing import Dict, List

from mlxpipe.bench.common import add_common_arguments, chat_prompt, long_text, median, pipeline_run
from mlxpipe.server.cluster.assembly import Cluster
from mlxpipe.server.cluster.config import ClusterConfig
from mlxpipe.shards.store import resolve_model


async def bench_prefill(args) -> dict:
    path = str(resolve_model(args.model))
    configs = {"chunked": args.chunk_size, "unchunked": 1 << 16}
    clusters = {}
    try:
        for name, chunk in configs.items():
            clusters[name] = await Cluster(ClusterConfig(model=path, stages=args.stages, pin=args.pin,
                                                         chunk_size=chunk)).start()
        tok = clusters["chunked"].tokenizer
        ttft: Dict[str, List[float]] = {n: [] for n in configs}
        for r in range(args.runs):
            for name, cluster in clusters.items():
                prompt = chat_prompt(tok, long_text(tok, args.prompt_tokens, f"{name}-{r}"))
                ttft[name].append((await pipeline_run(cluster, prompt, 2)).ttft_s)
    finally:
        for c in clusters.values():
            await c.stop()
    a, b = median(ttft["chunked"]), median(ttft["unchunked"])
    print(f"time to first token, {args.prompt_tokens}-token prompt, {args.stages} stages, {args.runs} runs:\n"
          f"  chunked ({args.chunk_size} tokens per frame): {a:.2f} s   runs {[round(x, 2) for x in ttft['chunked']]}\n"
          f"  unchunked:                         {b:.2f} s   runs {[round(x, 2) for x in ttft['unchunked']]}\n"
          f"  ratio: {a / b:.3f}")
    return {"chunk_size": args.chunk_size, "ttft": ttft, "ratio": a / b}


def add_parser(sub: argparse._SubParsersAction) -> None:
    q = add_common_arguments(sub.add_parser("prefill"))
    q.add_argument("--stages", type=int, default=2, help="local stage processes (default %(default)s)")
    q.add_argument("--prompt-tokens", type=int, default=1500, help="tokens of the prompt (default %(default)s)")
    q.add_argument("--chunk-size", type=int, default=256, help="prefill tokens per frame (default %(default)s)")
    q.set_defaults(measure=bench_prefill)
