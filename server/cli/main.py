"""The ``mlxpipe`` command."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
import time
from pathlib import Path

from mlxpipe.bench import command as bench
from mlxpipe.server.cli import certs, plan as plan_command, serve, status
from mlxpipe.server.cluster.assembly import Cluster
from mlxpipe.server.core.streams import GenerationFailed
from mlxpipe.server.cli.options import add_cluster_arguments, cluster_config
from mlxpipe.server.core.transport import PipelineError
from mlxpipe.server.api.textgen import stream_text
from mlxpipe.shards import node
from mlxpipe.shards.quant_spec import QuantSpec
from mlxpipe.shards.sampling import Sampling
from mlxpipe.shards.store import DEFAULT_MODEL, pull_default, resolve_model


def cmd_pull(args) -> int:
    """``mlxpipe pull [MODEL]``: the default model converted, or a Hugging Face repo downloaded."""
    if args.model == DEFAULT_MODEL:
        path = pull_default(progress=None if not args.quiet else False)
    else:
        if args.quiet:
            from huggingface_hub.utils import disable_progress_bars

            disable_progress_bars()
        path = resolve_model(args.model)
    print(path)
    return 0


def cmd_quantize(args) -> int:
    """``mlxpipe quantize``: a quantized folder, made one layer at a time (shards/quantize.py)."""
    from mlxpipe.shards.quantize import quantize_folder

    layer_bits = [b for b in args.layer_bits.split(",")] if args.layer_bits else None
    spec = QuantSpec.parse(args.bits, args.group_size, layer_bits)
    config = quantize_folder(resolve_model(args.model), Path(args.out), spec)
    own = sum(isinstance(v, dict) for v in config["quantization"].values())
    print(f"{args.out}: {spec.describe()} ({own} modules with bits of their own)")
    return 0


def cmd_generate(args) -> int:
    log = logging.getLogger("mlxpipe")

    async def run() -> None:
        async with Cluster(cluster_config(args)) as cluster:
            for line in cluster.describe():
                log.info(line)
            tok = cluster.tokenizer
            if args.no_chat or not tok.has_chat_template:
                prompt = tok.encode(args.prompt)
            else:
                prompt = tok.apply_chat_template(
                    [{"role": "user", "content": args.prompt}], add_generation_prompt=True
                )
            sampling = Sampling(temperature=args.temp, top_p=args.top_p, seed=args.seed)
            sampling.validate(cluster.vocab_size)
            stream = cluster.engine.submit(prompt, args.max_tokens, sampling)
            n = 0
            async for chunk in stream_text(tok, stream):
                n += len(chunk.tokens)
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
            sys.stdout.write("\n")
            if stream.first_token_at and n > 1:
                secs = time.monotonic() - stream.first_token_at
                log.info("%d prompt tokens, %d generated, %.2f tokens/s after the first",
                         len(prompt), n, (n - 1) / secs)

    asyncio.run(run())
    return 0


EPILOG = """\
examples:
  mlxpipe serve                                  2 local stages of the default model, API on 127.0.0.1:8000
  mlxpipe node --listen 0.0.0.0:50051 --secret-file ~/.mlxpipe-secret
                                                 a stage worker on this Mac, for a head elsewhere
  mlxpipe serve --nodes mac1:50051,mac2:50051 --secret-file ~/.mlxpipe-secret --model ~/models/M
                                                 drive workers on other Macs
  mlxpipe plan --model config.json --nodes 192GB,192GB --bits 4
                                                 which layers where, and the predicted tokens/s
  mlxpipe status                                 the running cluster as a table

docs: README.md, docs/ (quick start, several Macs, benchmarking, security, reliability, architecture)
"""


def build_parser() -> argparse.ArgumentParser:
    """The whole command line (tests check docker/compose.yaml's commands against it)."""
    parser = argparse.ArgumentParser(
        prog="mlxpipe",
        description="Run a model too large for one Mac across several: layer-sharded MLX stages "
                    "streaming micro-batched activations over gRPC, behind an OpenAI-compatible API.",
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress to stderr")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("serve", help="the OpenAI-compatible HTTP API over a pipeline "
                                     "(no arguments: 2 local stages of the default model on 127.0.0.1:8000)")
    add_cluster_arguments(p)
    serve.add_arguments(p)
    p.set_defaults(fn=lambda args: serve.run(args, cluster_config(args)))

    p = sub.add_parser("generate", help="generate text from one prompt through the pipeline")
    add_cluster_arguments(p)
    p.add_argument("prompt")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--temp", type=float, default=0.0, help="sampling temperature (0: greedy)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    p.set_defaults(fn=cmd_generate)

    p = sub.add_parser("node", help="run one stage worker that a head can drive")
    node.add_arguments(p)
    p.set_defaults(fn=node.run)

    p = sub.add_parser("plan", help="plan a split of a model over nodes, from its config alone (no weights)")
    plan_command.add_arguments(p)
    p.set_defaults(fn=plan_command.run)

    p = sub.add_parser("status", help="the cluster as a table: stages, layers, memory, health, load")
    status.add_arguments(p)
    p.set_defaults(fn=status.run)

    p = sub.add_parser("nodes", help="the nodes that joined a running head (`mlxpipe node --join`)")
    status.add_nodes_arguments(p)
    p.set_defaults(fn=status.run_nodes)

    p = sub.add_parser("bench", help="tokens/s of the pipeline beside plain mlx-lm, measured side by side")
    bench.add_arguments(p)
    p.set_defaults(fn=bench.run)

    p = sub.add_parser("quantize", help="quantize a full-precision model folder, one layer at a time "
                                        "(what mlx_lm.convert -q writes)")
    p.add_argument("--model", required=True, help="full-precision model folder (bf16, fp16, fp32, DeepSeek's FP8)")
    p.add_argument("--bits", required=True, help="2, 3, 4, 5, 6 or 8, or one of mlx-lm's mixed recipes (mixed_3_6, ...)")
    p.add_argument("--group-size", type=int, default=None, help="weights per scale and bias (default 64)")
    p.add_argument("--layer-bits", default=None,
                   help="bits (or a recipe) per layer, comma-separated, e.g. as `mlxpipe plan --bits auto --json` "
                        "lists them; --bits then applies to the embedding and the head")
    p.add_argument("out", help="the folder to write (must not exist)")
    p.set_defaults(fn=cmd_quantize)

    p = sub.add_parser("pull", help="fetch and convert the embedded default model once, or download a "
                                    "Hugging Face repo into its cache")
    p.add_argument("model", nargs="?", default=DEFAULT_MODEL,
                   help="a Hugging Face repo id such as mlx-community/Qwen3-4B-4bit (default: the embedded model)")
    p.add_argument("--quiet", action="store_true", help="no progress display")
    p.set_defaults(fn=cmd_pull)

    p = sub.add_parser("certs", help="make a small cluster's CA and node/client certificates (TLS)")
    certs.add_arguments(p)
    p.set_defaults(fn=certs.run)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, stream=sys.stderr,
                        format="%(message)s")
    try:
        return args.fn(args)
    except (ValueError, PipelineError, GenerationFailed) as err:
        # Errors a user can act on: the message, not a traceback (unless -v).
        if args.verbose:
            raise
        print(f"mlxpipe {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
