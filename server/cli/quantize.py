"""``mlxpipe quantize``: a quantized folder, made one layer at a time (``shards/models/quantize.py``)."""

from __future__ import annotations

import argparse
from pathlib import Path

from mlxpipe.server.config import ClusterConfig
from mlxpipe.shards.params.quant import QuantSpec


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="full-precision model folder (bf16, fp16, fp32, DeepSeek's FP8)")
    p.add_argument("--bits", required=True, help="2, 3, 4, 5, 6 or 8, or one of mlx-lm's mixed recipes (mixed_3_6, ...)")
    p.add_argument("--group-size", type=int, default=ClusterConfig.group_size,
                   help="weights per scale and bias (default %(default)s)")
    p.add_argument("--layer-bits", default=None,
                   help="bits (or a recipe) per layer, comma-separated, e.g. as `mlxpipe plan --bits auto --json` "
                        "lists them; --bits then applies to the embedding and the head")
    p.add_argument("out", help="the folder to write (must not exist)")


def run(args) -> int:
    layer_bits = [b for b in args.layer_bits.split(",")] if args.layer_bits else None
    spec = QuantSpec.parse(args.bits, args.group_size, layer_bits)
    from mlxpipe.shards.models.quantize import quantize_folder  # (deferred: MLX and mlx-lm, seconds to import)
    from mlxpipe.shards.models.store import resolve_model

    config = quantize_folder(resolve_model(args.model), Path(args.out), spec)
    own = sum(isinstance(v, dict) for v in config["quantization"].values())
    print(f"{args.out}: {spec.describe()} ({own} modules with bits of their own)")
    return 0
