"""``mlxpipe bench balance``: per-stage time per decode step under load, the planner's split vs
the even split. The load is decode alone (8 streams), so the planner balances for decode
alone (``--prompt-ratio 0``), not for ``serve``'s default chat mix."""

from __future__ import annotations

import argparse
import asyncio

from mlxpipe.bench.common import add_common_arguments
from mlxpipe.server.cluster.assembly import Cluster
from mlxpipe.server.config import ClusterConfig
from mlxpipe.shards.models.store import resolve_model


async def bench_balance(args) -> dict:
    path = str(resolve_model(args.model))
    out = {}
    for split in ("auto", "even"):
        async with Cluster(ClusterConfig(model=path, stages=args.stages, pin=args.pin, split=split,
                                               prompt_ratio=0.0)) as cluster:
            tok = cluster.tokenizer
            prompts = [tok.encode(f"Item {i}: ") for i in range(args.streams)]
            streams = [cluster.engine.submit(p, 100000, stop_at_eos=False) for p in prompts]
            consumers = [asyncio.ensure_future(_drain(s)) for s in streams]
            await asyncio.sleep(args.warmup)
            before = await cluster.pipeline.health()
            await asyncio.sleep(args.seconds)
            after = await cluster.pipeline.health()
            for s in streams:
                s.cancel()
            await asyncio.gather(*consumers, return_exceptions=True)
            per_step, busy = [], []
            for (_, h0, _), (_, h1, _) in zip(before, after):
                spent = h1.stats.busy_seconds - h0.stats.busy_seconds
                per_step.append(spent / max(h1.stats.frames - h0.stats.frames, 1))
                busy.append(spent / args.seconds)
            ranges = [(st.start, st.end) for st in cluster.pipeline.stages]
            spread = (max(per_step) - min(per_step)) / max(per_step)
            out[split] = {"ranges": ranges, "step_seconds": per_step, "busy": busy, "spread": spread}
            print(f"{split:5} split {ranges}: per-stage seconds per decode step "
                  f"{[round(x * 1000, 1) for x in per_step]} ms, spread {spread:.1%}, "
                  f"busy {[f'{b:.0%}' for b in busy]}")
    return out


async def _drain(stream) -> None:
    async for _ in stream:
        pass


def add_parser(sub: argparse._SubParsersAction) -> None:
    q = add_common_arguments(sub.add_parser("balance"))
    q.add_argument("--stages", type=int, default=ClusterConfig.stages,
                   help="local stage processes (default %(default)s)")
    q.add_argument("--streams", type=int, default=8, help="concurrent streams (default %(default)s)")
    q.add_argument("--warmup", type=float, default=10.0, help="seconds before measuring")
    q.add_argument("--seconds", type=float, default=30.0, help="seconds measured")
    q.set_defaults(measure=bench_balance)
