"""``mlxpipe bench prefill``: time to first token of a long prompt through the pipeline
(chunked prefill, the split ``serve`` plans by default), beside plain mlx-lm on the
same weights and prompt (in one piece, its default, and in the pipeline's chunks),
and beside the split balanced for decode alone (``--prompt-ratio 0``), in the
same run."""

from __future__ import annotations

import argparse
from typing import Dict, List

from mlxpipe.bench.common import Baseline, add_common_arguments, chat_prompt, long_text, median, pipeline_run
from mlxpipe.server.cluster.assembly import Cluster
from mlxpipe.server.cluster.planner import Workload
from mlxpipe.server.config import ClusterConfig
from mlxpipe.shards.models.store import resolve_model


async def bench_prefill(args) -> dict:
    path = str(resolve_model(args.model))
    ratios = {"pipeline": args.prompt_ratio, "pipeline, decode split": 0.0}
    if args.prompt_ratio == 0:
        del ratios["pipeline, decode split"]
    chunked = f"mlx-lm, chunks of {args.chunk_size}"
    ttft: Dict[str, List[float]] = {"mlx-lm": [], chunked: [], **{n: [] for n in ratios}}
    splits: Dict[str, list] = {}
    baseline = Baseline(path, 0 if args.pin else None)
    try:
        tok = None
        # One cluster at a time: idle stage processes of another would only share the cores.
        for name, ratio in ratios.items():
            cluster = await Cluster(ClusterConfig(model=path, stages=args.stages, pin=args.pin,
                                                  chunk_size=args.chunk_size, prompt_ratio=ratio)).start()
            try:
                tok = cluster.tokenizer
                splits[name] = [(st.start, st.end) for st in cluster.pipeline.stages]
                for r in range(args.runs):
                    prompt = chat_prompt(tok, long_text(tok, args.prompt_tokens, f"{name}-{r}"))
                    ttft[name].append((await pipeline_run(cluster, prompt, 2)).ttft_s)
            finally:
                await cluster.stop()
        for r in range(args.runs):
            prompt = chat_prompt(tok, long_text(tok, args.prompt_tokens, f"mlx-lm-{r}"))
            ttft["mlx-lm"].append(baseline.run(prompt, 2).ttft_s)
            # The pipeline's chunking alone, without its stages: mlx-lm prefilling in the same chunks.
            prompt = chat_prompt(tok, long_text(tok, args.prompt_tokens, f"mlx-lm-chunked-{r}"))
            ttft[chunked].append(baseline.run(prompt, 2, prefill_step_size=args.chunk_size).ttft_s)
    finally:
        baseline.close()
    base = median(ttft["mlx-lm"])
    lines = [f"time to first token, {args.prompt_tokens}-token prompt, {args.stages} stages, chunks of at most "
             f"{args.chunk_size}, {args.runs} runs (medians):"]
    for name, runs in ttft.items():
        split = f"   split {splits[name]}" if name in splits else ""
        lines.append(f"  {name:24}{median(runs):8.2f} s  {median(runs) / base:6.3f}x mlx-lm   "
                     f"runs {[round(x, 2) for x in runs]}{split}")
    print("\n".join(lines))
    return {"chunk_size": args.chunk_size, "prompt_ratio": args.prompt_ratio, "ttft": ttft, "splits": splits,
            "ratio": median(ttft["pipeline"]) / base}


def add_parser(sub: argparse._SubParsersAction) -> None:
    q = add_common_arguments(sub.add_parser("prefill"))
    q.add_argument("--stages", type=int, default=ClusterConfig.stages,
                   help="local stage processes (default %(default)s)")
    q.add_argument("--prompt-tokens", type=int, default=1500, help="tokens of the prompt (default %(default)s)")
    q.add_argument("--chunk-size", type=int, default=ClusterConfig.chunk_size,
                   help="prefill tokens per frame (default %(default)s)")
    q.add_argument("--prompt-ratio", type=float, default=Workload.prompt_ratio,
                   help="the workload the split is balanced for, as `serve --prompt-ratio` (default %(default)s)")
    q.set_defaults(measure=bench_prefill)
