"""Options of ``mlxpipe node`` that a head also takes, to pass on to the stage
processes it starts itself. Declared here, with no gRPC or MLX import, so that the
head's config tree (``server/config.py``) and the benchmarks take them as
they are."""

from __future__ import annotations

import argparse

LAUNCH_AHEAD_HELP = (
    "build each frame's graph while MLX runs what came before: launch each block as soon as it is built, "
    "and the next group's frame before the last one finishes. Default: on where MLX computes on a GPU; "
    "on MLX's CPU build it pays only with a core to spare (docs/benchmarks.md)")


def add_launch_ahead(parser: argparse.ArgumentParser, whose: str = "") -> None:
    """``--launch-ahead``/``--no-launch-ahead`` (``whose`` starts the help); neither
    given (None): the stage decides (``mlx_thread.py``)."""
    parser.add_argument("--launch-ahead", action=argparse.BooleanOptionalAction, default=None,
                        help=whose + LAUNCH_AHEAD_HELP)
