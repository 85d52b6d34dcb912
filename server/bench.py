"""``mlxpipe bench``: tokens per second of the pipeline beside plain mlx-lm, in one run.

Every configuration is started once and kept up; then the runs go round-robin
(mlx-lm, 1 stage, 2 stages, ...) so that a noisy machine slows all of them
alike. Reported figures are medians; ratios are against single-process mlx-lm
on the same model, prompt and token budget.

The mlx-lm baseline runs in its own process (``baseline_worker``), pinned
like a stage when ``--pin`` is given, so that it competes with nothing else.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional

logger = logging.getLogger(__name__)

DEFAULT_PROMPT = "Why is the sky blue? Explain it to a curious ten-year-old."


@dataclass
class RunResult:
    prompt_tokens: int
    generated: int
    ttft_s: float          # submit -> first token
    decode_tps: float      # tokens after the first / time after the first


@dataclass
class Series:
    name: str
    runs: List[RunResult] = field(default_factory=list)

    def median(self, attr: str) -> float:
        return statistics.median(getattr(r, attr) for r in self.runs) if self.runs else float("nan")


def _decode_rate(times: List[float]) -> float:
    return (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else float("nan")


# -- mlx-lm baseline, in a process of its own ----------------------------------


def baseline_worker(model: str, cpu: Optional[int]) -> None:
    """Read JSON requests on stdin, run plain mlx-lm ``generate_step``, answer JSON."""
    if cpu is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {cpu})
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    model_obj, _ = load(model)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        t0 = time.monotonic()
        times = []
        for _token, _ in generate_step(mx.array(req["prompt"]), model_obj, max_tokens=req["max_tokens"]):
            times.append(time.monotonic())
        print(json.dumps(asdict(RunResult(len(req["prompt"]), len(times), times[0] - t0,
                                          _decode_rate(times)))), flush=True)


class Baseline:
    def __init__(self, model: str, cpu: Optional[int]):
        cmd = [sys.executable, "-m", "mlxpipe.server.bench", "--baseline-worker", model]
        if cpu is not None:
            cmd += ["--cpu", str(cpu)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        ready = self.proc.stdout.readline()
        if not ready:
            raise RuntimeError("the mlx-lm baseline process failed to start")

    def run(self, prompt: List[int], max_tokens: int) -> RunResult:
        self.proc.stdin.write(json.dumps({"prompt": prompt, "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()
        return RunResult(**json.loads(self.proc.stdout.readline()))

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


# -- the pipeline ----------------------------------------------------------------


async def pipeline_run(cluster, prompt: List[int], max_tokens: int) -> RunResult:
    t0 = time.monotonic()
    times = []
    # Like mlx-lm's generate_step, do not stop at end-of-sequence: both sides
    # generate exactly max_tokens tokens.
    stream = cluster.engine.submit(prompt, max_tokens, stop_at_eos=False)
    async for _ in stream:
        times.append(time.monotonic())
    await cluster.engine.drain()
    return RunResult(len(prompt), len(times), times[0] - t0, _decode_rate(times))


async def single_stream(model: str, stage_counts: List[int], runs: int, max_tokens: int,
                        prompt_text: str, pin: bool, progress: bool) -> Dict[str, Series]:
    """Decode tokens/s of one stream: mlx-lm vs the pipeline at each stage count."""
    from mlxpipe.server.cluster import Cluster, ClusterConfig
    from mlxpipe.shards.store import resolve_model

    path = str(resolve_model(model))
    clusters = {}
    baseline = Baseline(path, 0 if pin else None)
    try:
        for n in stage_counts:
            clusters[n] = await Cluster(ClusterConfig(model=path, stages=n, pin=pin)).start()
        tok = clusters[stage_counts[0]].tokenizer
        prompt = tok.apply_chat_template([{"role": "user", "content": prompt_text}],
                                         add_generation_prompt=True)
        series = {"mlx-lm": Series("mlx-lm (1 process)")}
        series.update({f"{n}": Series(f"pipeline, {n} stage{'s' if n > 1 else ''}") for n in stage_counts})
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=runs * (1 + len(stage_counts)), desc="bench", unit="run", file=sys.stderr)
        for _ in range(runs):
            series["mlx-lm"].runs.append(baseline.run(prompt, max_tokens))
            if bar:
                bar.update()
            for n in stage_counts:
                series[f"{n}"].runs.append(await pipeline_run(clusters[n], prompt, max_tokens))
                if bar:
                    bar.update()
        if bar:
            bar.close()
        return series
    finally:
        baseline.close()
        for c in clusters.values():
            await c.stop()


def report(series: Dict[str, Series]) -> str:
    base = series["mlx-lm"].median("decode_tps")
    lines = [f"{'':28}{'decode tok/s':>14}{'ratio':>8}{'TTFT s':>9}   runs",
             f"{'':28}{'(median)':>14}{'':>8}{'(median)':>9}"]
    for s in series.values():
        tps = s.median("decode_tps")
        lines.append(f"{s.name:28}{tps:14.2f}{tps / base:8.3f}{s.median('ttft_s'):9.2f}   "
                     + " ".join(f"{r.decode_tps:.2f}" for r in s.runs))
    return "\n".join(lines)


def main(argv=None) -> int:
    import argparse

    if argv is None:
        argv = sys.argv[1:]
    if argv and argv[0] == "--baseline-worker":
        cpu = int(argv[argv.index("--cpu") + 1]) if "--cpu" in argv else None
        baseline_worker(argv[1], cpu)
        return 0
    parser = argparse.ArgumentParser(prog="mlxpipe bench")
    add_arguments(parser)
    return run(parser.parse_args(argv))


def add_arguments(p) -> None:
    p.add_argument("--model", default="default")
    p.add_argument("--stages", default="1,2,3", help="stage counts to measure, e.g. 1,2,3")
    p.add_argument("--runs", type=int, default=5, help="runs per configuration (medians are reported)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt", default=DEFAULT_PROMPT)
    p.add_argument("--pin", action="store_true", help="pin stage i (and the baseline) to CPU core i")
    p.add_argument("--json", default=None, help="also write the results as JSON to this file")


def run(args) -> int:
    stage_counts = [int(x) for x in args.stages.split(",")]
    series = asyncio.run(single_stream(args.model, stage_counts, args.runs, args.max_tokens,
                                       args.prompt, args.pin, sys.stderr.isatty()))
    print(f"one stream, {args.max_tokens} tokens, {args.runs} runs each")
    print(report(series))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({k: [asdict(r) for r in s.runs] for k, s in series.items()}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
