"""``mlxpipe bench kv``: what a quantized KV cache saves and costs, per stage.

For each KV setting (16: as the model computes, 8, 4 bits) and each context
length, every stage of an even split gets a sequence's caches (the stage's own,
``SlicedModel.make_cache``; quantized ones as a stage turns them,
``shards/cache/quantized.py``) holding that many positions, and reports:

- the MLX active memory the caches hold on each stage (what freeing them gives
  back, buffers allocated ahead included), beside the bytes of their arrays;
- decode tokens per second of one stream through the stages at that context
  (the stages run one after the other in this process: the sum of their step
  times, no wire), the settings timed round-robin.

The caches are filled with keys and values of the model's shape (random values,
written as the model's attention writes them): what they hold does not change
what they cost nor how long attention over them takes, and a 32k-token prefill
is not what is measured here. Every position is quantized (the quantized rows
start at position 0); ``docs/planning.md`` has the figures.

``--shape-of MODEL`` builds a tiny llama with that model's KV shape (layers, KV
heads, head dimension) and a long context, for contexts the model itself does
not allow (the default model stops at 8,192).
"""

from __future__ import annotations

import argparse
import gc
import json
import time
from pathlib import Path
from typing import Dict, List

import mlx.core as mx

from mlxpipe.bench.common import median
from mlxpipe.server.cli.options import table
from mlxpipe.server.cluster.splits import even_split
from mlxpipe.server.config import ClusterConfig
from mlxpipe.shards.cache import kinds
from mlxpipe.shards.models.digest import read_weights
from mlxpipe.shards.models.layers import with_sizes
from mlxpipe.shards.models.slicing import load_stage
from mlxpipe.shards.models.store import models_dir, resolve_model, text_config
from mlxpipe.shards.params.kv import KvQuant


def shape_model(like: Path, context: int, dtype: str = "bfloat16") -> Path:
    """A tiny random llama with ``like``'s KV shape and ``context`` positions (built once)."""
    from mlx_lm.models import llama
    from mlx_lm.utils import save_model

    cfg = with_sizes(text_config(json.loads((like / "config.json").read_text())))
    heads, kv_heads = int(cfg["num_attention_heads"]), int(cfg["num_key_value_heads"])
    head_dim = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    layers = int(cfg["num_hidden_layers"])
    out = models_dir() / f"kv-shape-{layers}x{kv_heads}x{head_dim}-{context}-{dtype}"
    if (out / "config.json").exists():
        return out
    config = {"model_type": "llama", "vocab_size": 512, "hidden_size": 64 * kv_heads, "intermediate_size": 128,
              "num_hidden_layers": layers, "num_attention_heads": kv_heads, "num_key_value_heads": kv_heads,
              "head_dim": head_dim, "max_position_embeddings": context, "rms_norm_eps": 1e-5,
              "rope_theta": 100000.0, "tie_word_embeddings": True, "torch_dtype": dtype}
    model = llama.Model(llama.ModelArgs.from_dict(config))
    model.set_dtype(getattr(mx, dtype))
    out.mkdir(parents=True, exist_ok=True)
    save_model(out, model)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def _fill(caches: list, shapes: List, positions: int) -> None:
    """``positions`` positions of keys and values of ``shapes`` ((KV heads, key dim, value
    dim, dtype) per cache; None: a cache that holds none) in a stage's caches, written as its
    layers write them (in chunks, through ``update_and_fetch``)."""
    for c, shape in zip(caches, shapes):
        if shape is None:
            continue
        heads, dk, dv, dtype = shape
        for a in range(0, positions, 2048):
            n = min(2048, positions - a)
            c.update_and_fetch(mx.random.normal((1, heads, n, dk)).astype(dtype),
                               mx.random.normal((1, heads, n, dv)).astype(dtype))
            mx.eval(kinds.arrays([c]))


def _shapes(stages) -> List[List]:
    """Per stage, (KV heads, key dim, value dim, dtype) of each of its caches (None: one that
    holds no keys), from one position through all of them (each stage gets the activations
    of the one before, in the model's dtype, as over the wire)."""
    out, h = [], None
    for st in stages:
        caches = st.make_cache()
        h = st(mx.zeros((1, 1), dtype=mx.int32), h, caches, [0])
        mx.eval(h)
        out.append([(c.keys.shape[1], c.keys.shape[3], c.values.shape[3], c.keys.dtype)
                    if isinstance(getattr(c, "keys", None), mx.array) else None for c in caches])
    return out


def fill(stages, hidden: int, bits: int, context: int, group_size: int) -> List[Dict]:
    """One stream's caches at ``context`` positions on every stage, and the MLX active memory
    and array bytes they hold there."""
    per_stage = []
    for st, shapes in zip(stages, _shapes(stages)):
        caches = st.make_cache()
        if bits < 16:
            switch, _, _ = kinds.kv_switch(st, hidden, KvQuant(bits, group_size, 0))
            switch.turn(caches)
        before = mx.get_active_memory()
        _fill(caches, shapes, context)
        per_stage.append({"caches": caches, "active_bytes": mx.get_active_memory() - before,
                          "cache_bytes": sum(c.nbytes for c in caches)})
    return per_stage


def decode_seconds(stages, per_stage: List[Dict], context: int, steps: int) -> float:
    """Seconds per token of ``steps`` decode steps through every stage from ``context``
    positions (taken back after, so every run starts at the same context)."""
    x = mx.zeros((1, 1), dtype=mx.int32)

    def step(i: int) -> mx.array:
        h = None
        for st, s in zip(stages, per_stage):
            h = st(x, h, s["caches"], [context + i])
        return h

    t0 = time.perf_counter()
    for i in range(steps):
        mx.eval(step(i))
    seconds = (time.perf_counter() - t0) / steps
    for s in per_stage:
        for c in s["caches"]:
            c.trim(steps)
    return seconds


def measure(stages, hidden: int, kv: List[int], context: int, args) -> List[Dict]:
    """Every KV setting at ``context``: caches filled for all, then decode timed round-robin
    (``args.runs`` rounds, so that a noisy neighbour slows every setting alike)."""
    held = {bits: fill(stages, hidden, bits, context, args.kv_group_size) for bits in kv}
    for bits in kv:  # the first steps compile kernels
        decode_seconds(stages, held[bits], context, 2)
    times: Dict[int, List[float]] = {bits: [] for bits in kv}
    for _ in range(args.runs):
        for bits in kv:
            times[bits].append(decode_seconds(stages, held[bits], context, args.steps))
    rows = [{"bits": bits, "context": context, "tokens_per_s": 1 / median(times[bits]),
             "runs_s": times[bits], "stages": [{k: s[k] for k in ("active_bytes", "cache_bytes")}
                                               for s in held[bits]]} for bits in kv]
    held.clear()
    gc.collect()
    mx.clear_cache()
    return rows


async def bench_kv(args) -> dict:
    path = resolve_model(args.model)
    contexts = [int(c) for c in args.contexts.split(",")]
    if args.shape_of:
        path = shape_model(resolve_model(args.shape_of), -(-(max(contexts) + args.steps + 16) // 4096) * 4096,
                           args.shape_dtype)
    cfg = with_sizes(text_config(json.loads((Path(path) / "config.json").read_text())))
    layers, hidden = int(cfg["num_hidden_layers"]), int(cfg["hidden_size"])
    limit = int(cfg.get("max_position_embeddings") or 1 << 30)
    contexts = [c for c in contexts if c + args.steps < limit] or [limit - args.steps - 1]
    stages = []
    for a, b in even_split(layers, args.stages):
        st, _ = load_stage(Path(path), a, b)
        read_weights(st).result()
        stages.append(st)
    kv = sorted({int(b) for b in args.kv.split(",")}, reverse=True)
    rows = [r for context in contexts for r in measure(stages, hidden, kv, context, args)]
    out = [["KV bits", "context"] + [f"stage {i} MB" for i in range(args.stages)]
           + ["bytes/token", "vs 16", "tok/s", "vs 16"]]
    full = {r["context"]: r for r in rows if r["bits"] == 16}
    for r in rows:
        total = sum(s["active_bytes"] for s in r["stages"])
        base = full.get(r["context"])
        out.append([str(r["bits"]), str(r["context"])] + [f"{s['active_bytes'] / 1e6:.1f}" for s in r["stages"]]
                   + [f"{total / r['context']:.0f}",
                      f"{total / sum(s['active_bytes'] for s in base['stages']):.3f}" if base else "",
                      f"{r['tokens_per_s']:.1f}", f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}" if base else ""])
    dtype = next(s for s in _shapes(stages)[0] if s is not None)[3]
    print(f"KV cache of one stream on each of {args.stages} stages of {Path(path).name} (MLX active memory; "
          f"16: unquantized, {str(dtype).split('.')[-1]}; group {args.kv_group_size}), and decode through "
          f"them ({args.steps} tokens, median of {args.runs} runs round-robin):")
    print(table(out, right=range(1, len(out[0]))))
    return {"model": str(path), "stages": args.stages, "kv_dtype": str(dtype), "rows": rows}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("kv")
    p.add_argument("--model", default=ClusterConfig.model, help="a model folder or 'default' (default %(default)s)")
    p.add_argument("--shape-of", default=None, metavar="MODEL",
                   help="measure a tiny random llama with MODEL's KV shape and a context long enough instead")
    p.add_argument("--shape-dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"),
                   help="with --shape-of: the tiny model's dtype (default %(default)s; MLX's CPU build multiplies "
                        "quantized keys far faster in float32)")
    p.add_argument("--contexts", default="1024,8192,32768",
                   help="positions in the cache, comma-separated (default %(default)s; those the model "
                        "allows)")
    p.add_argument("--kv", default="16,8,4", help="KV bits, comma-separated (16: as computed; default %(default)s)")
    p.add_argument("--kv-group-size", type=int, default=ClusterConfig.kv_group_size,
                   help="values per scale and bias (default %(default)s)")
    p.add_argument("--stages", type=int, default=ClusterConfig.stages, help="stages of an even split (default %(default)s)")
    p.add_argument("--steps", type=int, default=16, help="decode steps timed per run (default %(default)s)")
    p.add_argument("--runs", type=int, default=3, help="rounds of every setting, round-robin (default %(default)s)")
    p.add_argument("--json", default=None, help="also write the results as JSON to this file")
    p.set_defaults(measure=bench_kv)
