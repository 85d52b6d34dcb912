"""``mlxpipe bench MODE``; also the entry point of the plain mlx-lm baseline process.

    python -m mlxpipe.bench.command --baseline-worker MODEL
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys

from mlxpipe.bench import balance, chat, grammar, load, models, overhead, prefill, quality, soak, stream
from mlxpipe.bench.common import baseline_worker

# Each mode module adds its subcommand and the coroutine it runs (``measure``):
# a new mode is a new module and an entry here.
MODES = (stream, load, prefill, balance, chat, quality, grammar, soak, overhead, models)


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="mode", required=True, metavar="MODE")
    for mode in MODES:
        mode.add_parser(sub)


def run(args) -> int:
    result = asyncio.run(args.measure(args))
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--baseline-worker":
        baseline_worker(argv[1])
        return 0
    parser = argparse.ArgumentParser(prog="mlxpipe bench")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
