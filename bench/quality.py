"""``mlxpipe bench quality``: what quantizing costs, as perplexity on a fixed text (or,
with ``--task``, as an lm-evaluation-harness task's scores through a server at each
setting: ``lm_eval_task.py``).

The model (default: the embedded SmolLM2-135M-Instruct, dequantized once into a
bf16 folder that serves as the full-precision source) is quantized the way a
stage does it (``shards/models/quantize.py``) at each setting asked for, and scored
on ``quality.txt`` (public-domain and plain prose, in the repository) with the
model's own tokenizer: perplexity is exp of the mean negative log-likelihood
of each token given the ones before it, in one forward pass (activations in
float32, see ``widen``). ``auto`` is the
mix ``--bits auto`` chooses when the memory holds three quarters of the way
from the 3-bit to the 4-bit model.

``--kv 16,8,4`` adds a KV-cache axis: each setting is scored again with its
keys and values quantized to 8 and 4 bits as mlx-lm's ``QuantizedKVCache``
keeps them (``--kv-group-size``), every position attending to quantized keys
from the first token on. With a KV axis the text goes through the model in
chunks of ``--kv-chunk`` tokens through a cache, as a server prefills it (the
16-bit rows too, so that rows differ only in the cache).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map

from mlxpipe.server.cli.options import table
from mlxpipe.server.cluster.bits import plan_bits
from mlxpipe.server.cluster.cost import load_model_cost
from mlxpipe.server.cluster.planner import NodeSpec
from mlxpipe.server.config import ClusterConfig
from mlxpipe.shards.models.quantize import quantize_range
from mlxpipe.shards.models.store import DEFAULT_MODEL, models_dir, pull_default, resolve_model
from mlxpipe.shards.params.quant import QuantSpec

logger = logging.getLogger(__name__)

TEXT = Path(__file__).with_name("quality.txt")
FULL_PRECISION_NAME = "SmolLM2-135M-Instruct-bf16"
DEFAULT_SETTINGS = "bf16,8,6,4,mixed_3_6,3,auto"


def full_precision_default() -> Path:
    """The embedded model dequantized to bf16 (once): a real full-precision model to quantize.

    Its weights are exactly the Q4_1 GGUF's values (8-bit for the embedding),
    rounded to bf16; mlx-lm's ``dequantize_model`` and ``save`` do the work."""
    out = models_dir() / FULL_PRECISION_NAME
    if (out / "config.json").exists():
        return out
    from mlx_lm.utils import dequantize_model, load, save

    src = pull_default(progress=False)
    model, tokenizer, config = load(str(src), return_config=True, lazy=True)
    model = dequantize_model(model)
    model.update(tree_map(lambda v: v.astype(mx.bfloat16) if mx.issubdtype(v.dtype, mx.floating) else v,
                          model.parameters()))
    for key in ("quantization", "quantization_config"):
        config.pop(key, None)
    config["torch_dtype"] = "bfloat16"
    tmp = out.with_name(out.name + ".partial")
    if tmp.exists():
        import shutil

        shutil.rmtree(tmp)
    save(tmp, src, model, tokenizer, config)
    tmp.rename(out)
    return out


def widen(model: nn.Module) -> None:
    """Floating parameters (norms, scales and biases, unquantized weights) to float32, which
    is exact: the quantized weights stay what they are, and the activations run in float32
    (MLX's CPU quantized matmul is about ten times slower in bf16)."""
    model.update(tree_map(lambda v: v.astype(mx.float32) if mx.issubdtype(v.dtype, mx.floating) else v,
                          model.parameters()))


def perplexity(model: nn.Module, tokens: List[int]) -> float:
    """exp of the mean negative log-likelihood of tokens[1:] given what precedes each."""
    x = mx.array(tokens)[None]
    logits = model(x[:, :-1]).astype(mx.float32)
    nll = nn.losses.cross_entropy(logits, x[:, 1:], reduction="mean")
    return math.exp(nll.item())


def perplexity_cached(model: nn.Module, tokens: List[int], kv_bits: Optional[int], group_size: int,
                      chunk: int) -> float:
    """``perplexity`` with the text in chunks of ``chunk`` tokens through a KV cache, quantized
    to ``kv_bits`` from the first position (None: full precision)."""
    from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache

    cache = make_prompt_cache(model)
    if kv_bits:  # the caches mlx-lm quantizes: plain KVCaches
        cache = [QuantizedKVCache(group_size=group_size, bits=kv_bits) if type(c) is KVCache else c for c in cache]
    x = mx.array(tokens)[None]
    total = 0.0
    for a in range(0, len(tokens) - 1, chunk):
        b = min(a + chunk, len(tokens) - 1)
        logits = model(x[:, a:b], cache=cache).astype(mx.float32)
        total += nn.losses.cross_entropy(logits, x[:, a + 1 : b + 1], reduction="sum").item()
    return math.exp(total / (len(tokens) - 1))


def auto_spec(path: Path, group_size: int, context: int = 256) -> QuantSpec:
    """What ``--bits auto`` picks for a node that holds three quarters of the way from
    the 3-bit to the 4-bit model (plus the KV cache of ``context`` tokens)."""
    cost_of = lambda spec: load_model_cost(path, quant=spec)  # noqa: E731
    three, four = (cost_of(QuantSpec(b, group_size)) for b in ("3", "4"))
    kv = sum(l.kv_bytes_per_token for l in four.layers) * context
    node = NodeSpec("node", (three.weight_bytes + 3 * four.weight_bytes) // 4 + kv, bandwidth_bytes_per_s=100e9)
    return plan_bits(cost_of, [node], group_size=group_size, context=context).spec


def measure(path: Path, settings: List[str], tokens: List[int], group_size: int,
            kv: Sequence[int] = (16,), kv_group_size: int = ClusterConfig.kv_group_size,
            kv_chunk: int = 256) -> List[Dict]:
    """One row per setting (and KV bits, with ``kv`` other than 16 alone): its name, spec,
    mean bits, weight bytes, KV bits, perplexity, seconds."""
    from mlx_lm.utils import load_model

    rows = []
    for setting in settings:
        t0 = time.perf_counter()
        if setting in ("bf16", "full"):
            spec, (model, _) = None, load_model(path)
        else:
            spec = auto_spec(path, group_size) if setting == "auto" else QuantSpec.parse(setting, group_size)
            model, _ = quantize_range(path, 0, load_model_cost(path).num_layers, spec)
        weight_bytes = sum(a.nbytes for _, a in tree_flatten(model.parameters()))
        widen(model)
        mean = load_model_cost(path, quant=spec).mean_bits if spec else 16.0
        for kv_bits in kv:
            if list(kv) == [16]:
                ppl = perplexity(model, tokens)
            else:
                ppl = perplexity_cached(model, tokens, kv_bits if kv_bits < 16 else None, kv_group_size, kv_chunk)
            rows.append({"setting": setting, "quantization": spec.describe() if spec else "as stored",
                         "mean_bits": mean, "weight_bytes": weight_bytes, "kv_bits": kv_bits, "perplexity": ppl,
                         "seconds": time.perf_counter() - t0})
            t0 = time.perf_counter()
        del model
        mx.clear_cache()
    return rows


async def bench_quality(args) -> dict:
    from_source = args.model == DEFAULT_MODEL and not (args.task and args.url)  # (--url: its tokenizer only)
    path = full_precision_default() if from_source else resolve_model(args.model)
    if args.task:  # a task of the user's own, through a server at each setting
        from mlxpipe.bench.lm_eval_task import bench_task

        return await asyncio.to_thread(bench_task, args, Path(path))
    from mlx_lm.utils import load_tokenizer

    tokenizer = load_tokenizer(path)
    text = Path(args.text).read_text() if args.text else TEXT.read_text()
    tokens = tokenizer.encode(text)[: args.max_tokens]
    settings = [s.strip() for s in args.settings.split(",") if s.strip()]
    kv = sorted({int(b) for b in args.kv.split(",")}, reverse=True)
    if not set(kv) <= {16, 8, 4}:
        raise SystemExit(f"--kv: give 16, 8 and/or 4, not {args.kv}")
    rows = measure(Path(path), settings, tokens, args.group_size, kv, args.kv_group_size, args.kv_chunk)
    base = next((r["perplexity"] for r in rows if r["setting"] in ("bf16", "full")), None)
    out = [["setting", "quantization", "bits", "weights MB", "KV bits", "perplexity", "vs bf16", "vs 16-bit KV"]]
    for r in rows:
        delta = f"{100 * (r['perplexity'] / base - 1):+.1f}%" if base else ""
        same = next(x["perplexity"] for x in rows if x["setting"] == r["setting"])
        out.append([r["setting"], r["quantization"], f"{r['mean_bits']:.2f}", f"{r['weight_bytes'] / 1e6:.1f}",
                    str(r["kv_bits"]), f"{r['perplexity']:.3f}", delta, f"{100 * (r['perplexity'] / same - 1):+.2f}%"])
    print(f"perplexity of {Path(path).name} on {len(tokens)} tokens of "
          f"{Path(args.text).name if args.text else TEXT.name}, group size {args.group_size}"
          + (f", KV in chunks of {args.kv_chunk} (group {args.kv_group_size})" if kv != [16] else "") + ":")
    print(table(out, right=range(2, 8)))
    return {"model": str(path), "tokens": len(tokens), "group_size": args.group_size, "rows": rows}


def add_parser(sub: argparse._SubParsersAction) -> None:
    q = sub.add_parser("quality")
    q.add_argument("--model", default=DEFAULT_MODEL,
                   help="a full-precision model folder (default: the embedded model dequantized to bf16)")
    q.add_argument("--settings", "--bits", default=DEFAULT_SETTINGS,
                   help=f"comma-separated: bf16 (as stored), bits, mlx-lm recipes, auto (default {DEFAULT_SETTINGS})")
    q.add_argument("--task", default=None,
                   help="score an lm-evaluation-harness task instead (a task YAML of your own, or a task name): "
                        "through `mlxpipe serve --bits SETTING` at each setting, or the server at --url")
    q.add_argument("--include-path", default=None, help="with --task NAME: the folder of your task YAMLs")
    q.add_argument("--url", default=None, help="with --task: score this running server (what it serves) instead")
    q.add_argument("--stages", type=int, default=ClusterConfig.stages,
                   help="with --task: stages of each server started (default %(default)s)")
    q.add_argument("--limit", type=int, default=None, help="with --task: score only this many documents")
    q.add_argument("--group-size", type=int, default=ClusterConfig.group_size,
                   help="weights per quantization scale and bias (default %(default)s)")
    q.add_argument("--kv", default="16", help="KV-cache bits to score each setting at, comma-separated, e.g. 16,8,4 "
                   "(default %(default)s: no KV quantization, the text in one pass)")
    q.add_argument("--kv-group-size", type=int, default=ClusterConfig.kv_group_size,
                   help="values per scale and bias of a quantized KV cache (default %(default)s)")
    q.add_argument("--kv-chunk", type=int, default=256, help="with --kv: tokens per forward through the cache "
                   "(default %(default)s)")
    q.add_argument("--text", default=None, help="a text file to score (default: bench/quality.txt)")
    q.add_argument("--max-tokens", type=int, default=512, help="score at most this many tokens of the text")
    q.add_argument("--json", default=None, help="also write the results as JSON to this file")
    q.set_defaults(measure=bench_quality)
