"""``mlxpipe bench stall``: what the stall bound costs a prompt that runs alone.

A long prompt's time to first token with ``--max-stall`` (serve's default: each
prefill chunk holds a stage at most that long, ``server/core/prefill.py``)
against ``--max-stall 0`` (chunks of ``--chunk-size`` regardless), the same
prompt and split, side by side in one run. Each setting gets a cluster of its
own, started with an empty prefix cache: fresh stage processes (nothing in
memory) and the disk tier's blocks removed from the bench's ``$MLXPIPE_HOME``,
so that neither run reuses the other's positions. By default the model is a
tiny long-context one (``bench/tiny.py`` ``LONG_CONTEXT``: DeepSeek-V3's YaRN
x40 at toy size, one full-attention layer a stage), as issue 47's bar asks
(``--stages 3``): a lone 32k prompt at 3 stages within 1.15x of its time with
``--max-stall 0``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from pathlib import Path
from typing import Dict, List

from mlxpipe.bench import tiny
from mlxpipe.bench.common import add_common_arguments, median, pipeline_run
from mlxpipe.server.cluster.assembly import Cluster
from mlxpipe.server.config import ClusterConfig
from mlxpipe.shards.models.store import resolve_model

WARM = 64  # tokens of a first, different prompt: kernels compiled and prefill frames timed, as on a served head


def _prompt(tokens: int, salt: int = 0) -> List[int]:
    """Token ids of a prompt (as tests/test_long_context.py makes them), all under the tiny vocabulary."""
    return [(i * 7919 + salt) % 40000 + 100 for i in range(tokens)]


def _model(args, home: Path) -> str:
    """``--model`` as given, or the tiny long-context ``--tiny`` model built under ``home`` (one
    full-attention layer per stage at least)."""
    if args.model is not None:
        return str(resolve_model(args.model))
    extra = dict(tiny.LONG_CONTEXT[args.tiny])
    extra["num_hidden_layers"] = max(extra["num_hidden_layers"], args.stages)
    out = home / "models" / f"tiny-long-{args.tiny}-{extra['num_hidden_layers']}"
    if not (out / "config.json").exists():
        tokenizer = resolve_model("default")  # (from the home it is in, before the bench's is set)
        tiny.build(args.tiny, out, tokenizer, extra=extra)
    return str(out)


def _fresh_cache(home: Path) -> None:
    """No prefix-cache blocks on disk, and no workload measured by a run before (it would move the split)."""
    for name in ("prefix-cache", "workload"):
        shutil.rmtree(home / name, ignore_errors=True)


async def _one(args, path: str, stall: float, home: Path) -> Dict:
    """A cluster with ``--max-stall stall`` from an empty prefix cache: a warm-up prompt, then the long one."""
    _fresh_cache(home)
    cluster = await Cluster(ClusterConfig(model=path, stages=args.stages, pin=args.pin, chunk_size=args.chunk_size,
                                          max_stall=stall)).start()
    try:
        await pipeline_run(cluster, _prompt(WARM, salt=1), 1)
        budget = getattr(cluster.pipeline, "budget", None)
        if budget is not None:
            budget.reset()
        run = await pipeline_run(cluster, _prompt(args.prompt_tokens), args.max_tokens)
        prefill = cluster.engine.frame_budget().get("prefill")
        frames, tokens = (prefill.frames, prefill.tokens) if prefill is not None else (0, 0)
        busy = [round(sum(parts[1:]), 2) for parts in prefill.stages] if prefill is not None else []
        return {"ttft_s": run.ttft_s, "tokens": run.tokens, "frames": frames, "positions": tokens, "busy_s": busy,
                "split": [(st.start, st.end) for st in cluster.pipeline.stages]}
    finally:
        await cluster.stop()


async def bench_stall(args) -> dict:
    if args.max_stall <= 0:
        raise SystemExit("mlxpipe bench stall: --max-stall must be positive (it is measured against 0)")
    home = Path(args.home) if args.home else Path(tempfile.mkdtemp(prefix="mlxpipe-stall-"))
    path = _model(args, home)
    previous = os.environ.get("MLXPIPE_HOME")
    os.environ["MLXPIPE_HOME"] = str(home)  # (the stage processes inherit it: their disk tier is there)
    stalls = [args.max_stall, 0.0]
    runs: Dict[float, List[Dict]] = {s: [] for s in stalls}
    try:
        for _ in range(args.runs):
            for stall in stalls:
                runs[stall].append(await _one(args, path, stall, home))
    finally:
        if previous is None:
            os.environ.pop("MLXPIPE_HOME", None)
        else:
            os.environ["MLXPIPE_HOME"] = previous
        if not args.home:
            shutil.rmtree(home, ignore_errors=True)
    ttft = {s: median([r["ttft_s"] for r in runs[s]]) for s in stalls}
    ratio = ttft[args.max_stall] / ttft[0.0]
    same = all(r["tokens"] == runs[0.0][0]["tokens"] for s in stalls for r in runs[s])
    lines = [f"a lone {args.prompt_tokens}-token prompt's time to first token, {args.stages} stages, chunks of at most "
             f"{args.chunk_size}, {Path(path).name}, {args.runs} run(s) (medians), each from an empty prefix cache:"]
    for s in stalls:
        last = runs[s][-1]
        per_frame = last["positions"] / max(last["frames"], 1)
        lines.append(f"  --max-stall {s:<5g}{ttft[s]:10.2f} s   {last['frames']} prefill frames, {per_frame:.1f} "
                     f"positions each on average; stages busy {last['busy_s']} s; split {last['split']}; "
                     f"runs {[round(r['ttft_s'], 2) for r in runs[s]]}")
    lines.append(f"  ratio {ratio:.3f}x (--max-stall {args.max_stall:g} over --max-stall 0); "
                 f"same tokens: {'yes' if same else 'NO'}")
    print("\n".join(lines))
    return {"prompt_tokens": args.prompt_tokens, "stages": args.stages, "model": path, "max_stall": args.max_stall,
            "ttft_s": {str(s): ttft[s] for s in stalls}, "ratio": ratio, "same_tokens": same,
            "runs": {str(s): runs[s] for s in stalls}}


def add_parser(sub: argparse._SubParsersAction) -> None:
    q = add_common_arguments(sub.add_parser("stall"))
    q.set_defaults(model=None, runs=1)
    q.add_argument("--tiny", choices=sorted(tiny.LONG_CONTEXT), default="deepseek_v3",
                   help="without --model: the tiny long-context model built and measured (default %(default)s)")
    q.add_argument("--stages", type=int, default=ClusterConfig.stages,
                   help="local stage processes (default %(default)s; issue 47's bar: 3)")
    q.add_argument("--prompt-tokens", type=int, default=32768, help="tokens of the prompt (default %(default)s)")
    q.add_argument("--max-tokens", type=int, default=2, help="tokens generated (default %(default)s)")
    q.add_argument("--chunk-size", type=int, default=ClusterConfig.chunk_size,
                   help="prefill tokens per frame, at most (default %(default)s)")
    q.add_argument("--max-stall", type=float, default=ClusterConfig.max_stall,
                   help="the bound measured against 0 (default: serve's, %(default)s)")
    q.add_argument("--home", default=None,
                   help="the $MLXPIPE_HOME of the runs (default: a fresh folder, removed after); its prefix-cache "
                        "blocks on disk are removed before each run")
    q.set_defaults(measure=bench_stall)
