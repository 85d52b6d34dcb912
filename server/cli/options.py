"""What the client commands share (``status``, ``nodes``, ``plan``, ``bench``): the
head's API key and the plain-text table they print. The server's options are the
config tree's (``server/config.py``)."""

from __future__ import annotations

import argparse
import os
from typing import Container, List

from mlxpipe.proto.rpc import read_secret


def api_key(args: argparse.Namespace) -> str:
    """The head's API key: --api-key-file (its first key, for a file the head reads
    too: ``KEY [field=value ...]`` a line), else $MLXPIPE_API_KEY, else ""."""
    if args.api_key_file:
        lines = read_secret(args.api_key_file, "--api-key-file").splitlines()
        return next((k.split()[0] for k in lines if k.strip() and not k.strip().startswith("#")), "")
    return os.environ.get("MLXPIPE_API_KEY", "")


def table(rows: List[List[str]], right: Container[int] = ()) -> str:
    """Rows of cells in aligned columns; columns whose index is in ``right`` (numbers) align right."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]

    def cell(j: int, c: str) -> str:
        return c.rjust(widths[j]) if j in right else c.ljust(widths[j])

    return "\n".join("  ".join(cell(j, c) for j, c in enumerate(r)).rstrip() for r in rows)
