"""``mlxpipe bench MODE``; also the entry point of the plain mlx-lm baseline process.

    python -m mlxpipe.bench.command --baseline-worker MODEL

The CLI (``server/cli/main.py``) names this module; it names nothing of the CLI's:
its modes are subcommands of the lazy parser the CLI hands it (``add_arguments``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys

# Each mode is a module of mlxpipe.bench (named as the mode) that adds its options and
# the coroutine it runs (``measure``), imported only when the mode is used (`mlxpipe
# bench --help` imports none: they pull in MLX, mlx-lm and the cluster, seconds).
# A new mode is a new module and an entry here.
MODES = (
    ("stream", "one stream: mlx-lm vs the pipeline at 1, 2, 3 stages"),
    ("served", "one stream through mlxpipe serve as started by default vs mlx_lm.server: a copy task and a "
               "chat prompt, speculation on and off"),
    ("load", "concurrent HTTP clients: mlxpipe serve vs mlx_lm.server"),
    ("prefill", "time to first token of a long prompt: chunked prefill vs not"),
    ("fairness", "a short request's time to first token while long prompts prefill: mlxpipe serve vs "
                 "mlx_lm.server"),
    ("stall", "a lone long prompt's time to first token with --max-stall against --max-stall 0 (by default "
              "32k positions on a tiny long-context model)"),
    ("balance", "per-stage step time under load: planner split vs even split"),
    ("chat", "multi-turn chat and agent-like prompts: prefix reuse, mlxpipe serve vs mlx_lm.server"),
    ("quality", "perplexity of a model at full precision and quantized at several bits"),
    ("kv", "KV-cache memory per stage and decode speed at long contexts, at 16, 8 and 4 bits"),
    ("grammar", "per-token cost of a JSON-schema grammar on the last stage"),
    ("soak", "a bounded soak: streaming clients, random hang-ups, stages killed on a clock"),
    ("overhead", "the pipeline's own cost per hop (a model of negligible compute) beside a raw gRPC ping-pong "
                 "and mlx-lm; and where a real model's decode token goes"),
    ("embeddings", "embeddings per second: mlxpipe serve --embedding-model over HTTP vs the model's own library "
                   "in one process, vectors checked equal"),
    ("models", "every mlx-lm architecture through the pipeline: equality with mlx-lm plain, after a prefix-cache "
               "hit, while speculating, after a replay"),
    ("mtp", "drafts from the model itself: an MTP head trained briefly on the model's own answers, acceptance and "
            "decode tok/s beside speculation off"),
    ("tracing", "what OpenTelemetry tracing costs a decode token: mlxpipe serve with tracing off, on, and (--before) "
                "from an install without it"),
    ("tp", "a stage split across 2 ranks (tensor parallel) beside mlx-lm, mlx_lm.server, the 2-stage pipeline and "
           "mlx_lm.server under 2 ring ranks: one stream and 8"),
    ("vision", "time to first token for an image and a question: mlxpipe serve vs mlx-vlm in one process; the "
               "head's vision tower, planned and measured"),
    ("openwebui", "Open WebUI (from PyPI, in a venv of its own) on mlxpipe serve, driven in headless Chromium: "
                  "chat and the RAG embeddings of an uploaded file, both served by mlxpipe; checked"),
)


class _Into:
    """What a mode module's ``add_parser(sub)`` calls ``sub.add_parser`` on: it gets
    the mode's own parser back, to add its options to."""

    def __init__(self, parser: argparse.ArgumentParser):
        self.parser = parser

    def add_parser(self, name: str, **kw) -> argparse.ArgumentParser:
        return self.parser


def _attach_mode(parser: argparse.ArgumentParser, module) -> None:
    module.add_parser(_Into(parser))


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The modes, as subcommands of ``p``'s class: the CLI's lazy parser (``LazyCommand``),
    which imports a mode's module when the mode is used."""
    sub = p.add_subparsers(dest="mode", required=True, metavar="MODE")
    for name, help in MODES:
        sub.add_parser(name, help=help, module=f"mlxpipe.bench.{name}", attach=_attach_mode)


def run(args) -> int:
    result = asyncio.run(args.measure(args))
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 1 if isinstance(result, dict) and result.get("failed") else 0  # a mode whose checks failed


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2 or argv[0] != "--baseline-worker":
        print("usage: python -m mlxpipe.bench.command --baseline-worker MODEL (the modes: mlxpipe bench)",
              file=sys.stderr)
        return 2
    from mlxpipe.bench.common import baseline_worker

    baseline_worker(argv[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())
