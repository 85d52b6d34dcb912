"""``mlxpipe bench mtp``: drafts from the model itself, on a model that ships no MTP head.

The default model (SmolLM2, a llama) has no multi-token-prediction head, so this mode
trains one briefly on the model's own greedy answers to chat prompts
(``mtp_head.py``: a llama block with the model's embedding and output head, minutes on
a CPU), writes it into a copy of the model folder under the ``mtp.*`` names a
checkpoint uses, and serves that folder: the last stage loads the head as it would a
real checkpoint's (``shards/models/mtp.py``) and drafts with it. Then one stream at a
time, greedy, on chat prompts the head never saw, with ``"speculation": "mtp"`` and
``"none"``, side by side in one run: decode tokens/s after the first token (medians)
and the head's acceptance (the usage's ``speculation.mtp``), texts checked identical.
A trained head is kept under ``$MLXPIPE_HOME/bench/mtp/`` by model and training
settings, and used again (``--retrain`` trains afresh).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shlex
import sys
from pathlib import Path
from typing import Dict

import httpx

from mlxpipe.bench.common import HttpServer, add_common_arguments, median, pin_flags, progress_bar, stream_chat
from mlxpipe.server.config import ClusterConfig
from mlxpipe.shards.models.store import fingerprint, mlxpipe_home, resolve_model

# Chat prompts the head never saw in training (``mtp_head.TRAIN_PROMPTS``).
EVAL_PROMPTS = ["Why is the sky blue? Explain it to a curious ten-year-old.",
                "How do trees drink water?", "What is the difference between weather and climate?"]


def _head(args) -> Path:
    """The model folder with a trained MTP head (trained now, or the one kept from before)."""
    from mlxpipe.bench import mtp_head

    src = resolve_model(args.model)
    key = hashlib.sha256(json.dumps([fingerprint(src), args.train_prompts, args.train_tokens, args.steps,
                                     args.lr]).encode()).hexdigest()[:16]
    out = mlxpipe_home() / "bench" / "mtp" / f"{src.name}-{key}"
    done = out / "trained.json"
    if done.exists() and not args.retrain:
        print(f"MTP head: {out} (trained before: {done.read_text().strip()})")
        return out
    print(f"training an MTP head for {src.name}: {args.train_prompts} prompts, {args.train_tokens} tokens each, "
          f"{args.steps} steps (into {out})")
    from mlx_lm.utils import load_tokenizer

    tok = load_tokenizer(src)
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
               for p in mtp_head.TRAIN_PROMPTS[: args.train_prompts]]
    info = mtp_head.train(src, out, prompts, tokens=args.train_tokens, steps=args.steps, lr=args.lr,
                          progress=lambda line: print(f"  {line}", flush=True))
    done.write_text(json.dumps(info))
    print(f"trained: {info}")
    return out


async def _one(http: httpx.AsyncClient, url: str, prompt: str, max_tokens: int, speculation: str):
    body = {"model": "default", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "speculation": speculation}
    times, text, usage = await stream_chat(http, url, body)
    span = times[-1] - times[0] if len(times) > 1 else float("nan")
    tokens = usage.get("completion_tokens") or 0
    mtp = (usage.get("speculation") or {}).get("mtp") or {}
    return (tokens - 1) / span if span > 0 else float("nan"), text, mtp


async def bench_mtp(args) -> dict:
    folder = _head(args)
    modes = [("MTP off", "none"), ("MTP", "mtp")]
    series: Dict[str, Dict[str, list]] = {p: {m: [] for m, _ in modes} for p in args.prompt}
    server = HttpServer("mlxpipe", [sys.executable, "-m", "mlxpipe.server.cli", "serve", "--port", "0", "--model",
                                    str(folder), "--stages", str(args.stages)] + pin_flags(args.pin)
                        + shlex.split(args.serve_args))
    try:
        bar = progress_bar(args.runs * len(args.prompt) * len(modes), "mtp")
        async with httpx.AsyncClient(timeout=1200) as http:
            for prompt in args.prompt:  # warm: the first requests compile kernels
                for _, spec in modes:
                    await _one(http, server.url, prompt, 8, spec)
            for _ in range(args.runs):
                for prompt in args.prompt:
                    for name, spec in modes:
                        series[prompt][name].append(await _one(http, server.url, prompt, args.max_tokens, spec))
                        if bar:
                            bar.update(1)
        if bar:
            bar.close()
    finally:
        server.close()
    return _report(args, series)


def _report(args, series: Dict[str, Dict[str, list]]) -> dict:
    lines = [f"one stream through `mlxpipe serve --stages {args.stages}` on {args.model} with a trained MTP head, "
             f"{args.max_tokens} tokens at most, greedy, {args.runs} runs; decode tok/s (medians)",
             f"  {'prompt':44}{'MTP off':>9}{'MTP':>9}{'speedup':>9}{'accepted':>10}  text"]
    out: Dict[str, dict] = {}
    for prompt, runs in series.items():
        off, on = median([r[0] for r in runs["MTP off"]]), median([r[0] for r in runs["MTP"]])
        drafted = sum(r[2].get("drafted_tokens", 0) for r in runs["MTP"])
        accepted = sum(r[2].get("accepted_tokens", 0) for r in runs["MTP"])
        same = all(r[1] == runs["MTP off"][0][1] for rs in runs.values() for r in rs)
        rate = accepted / drafted if drafted else float("nan")
        lines.append(f"  {prompt[:43]:44}{off:9.2f}{on:9.2f}{on / off:8.2f}x{rate:9.0%}   "
                     f"{'identical' if same else 'DIFFERS'}")
        out[prompt] = {"off_tok_s": [r[0] for r in runs["MTP off"]], "mtp_tok_s": [r[0] for r in runs["MTP"]],
                       "off_median": off, "mtp_median": on, "speedup": on / off, "drafted": drafted,
                       "accepted": accepted, "acceptance": rate, "identical": same}
    print("\n".join(lines))
    return out


def add_parser(sub: argparse._SubParsersAction) -> None:
    q = add_common_arguments(sub.add_parser("mtp"))
    q.add_argument("--stages", type=int, default=ClusterConfig.stages, help="local stage processes (default %(default)s)")
    q.add_argument("--max-tokens", type=int, default=128, help="tokens per answer, at most (default %(default)s)")
    q.add_argument("--prompt", action="append", default=None,
                   help="a chat prompt to measure on (again for more; default: three the head never saw)")
    q.add_argument("--train-prompts", type=int, default=40, help="chat prompts the head learns from (default "
                   "%(default)s, at most 40)")
    q.add_argument("--train-tokens", type=int, default=96, help="greedy tokens per training prompt (default "
                   "%(default)s)")
    q.add_argument("--steps", type=int, default=400, help="training steps, 64 positions of one answer each "
                   "(default %(default)s)")
    q.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (default %(default)s)")
    q.add_argument("--retrain", action="store_true", help="train afresh even where a head was kept")
    q.add_argument("--serve-args", default="", help="more options for the mlxpipe serve it starts")
    q.set_defaults(measure=_measure)


async def _measure(args) -> dict:
    args.prompt = args.prompt or EVAL_PROMPTS
    return await bench_mtp(args)
