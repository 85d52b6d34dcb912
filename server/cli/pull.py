"""``mlxpipe pull [MODEL]``: the default model converted, or a Hugging Face repo downloaded."""

from __future__ import annotations

import argparse

from huggingface_hub.utils import disable_progress_bars

from mlxpipe.shards.models.store import DEFAULT_MODEL, pull_default, resolve_model


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=DEFAULT_MODEL,
                   help="a Hugging Face repo id such as mlx-community/Qwen3-4B-4bit (default: the embedded model)")
    p.add_argument("--quiet", action="store_true", help="no progress display")


def run(args) -> int:
    if args.model == DEFAULT_MODEL:
        path = pull_default(progress=None if not args.quiet else False)
    else:
        if args.quiet:
            disable_progress_bars()
        path = resolve_model(args.model)
    print(path)
    return 0
