"""``mlxpipe nodes``: the nodes that joined a running head (its ``/nodes``)."""

from __future__ import annotations

import time

import httpx

from mlxpipe.server.cli.options import api_key, table
from mlxpipe.server.cli.running import DEFAULT_URL, head_url


def get_head(url: str, key: str, path: str):
    """GET ``path`` from the head at ``url`` (given with or without /v1)."""
    r = httpx.get(url.rstrip("/").removesuffix("/v1") + path,
                  headers={"Authorization": f"Bearer {key}"} if key else {}, timeout=10)
    if r.status_code == 401:
        raise ValueError("the head needs an API key: --api-key-file")
    return r


def add_arguments(p) -> None:
    """The head to ask, and its key (`mlxpipe nodes`; `mlxpipe status` adds its own)."""
    p.add_argument("--url", default=None, help="a running head (default: $MLXPIPE_URL, else the one `mlxpipe serve` "
                                               f"on this machine announced, else {DEFAULT_URL})")
    p.add_argument("--api-key-file", default=None, help="file with the head's API key (or $MLXPIPE_API_KEY)")


def run(args) -> int:
    args.url = head_url(args.url)
    try:
        r = get_head(args.url, api_key(args), "/nodes")
    except httpx.HTTPError as err:
        raise ValueError(f"cannot reach the head at {args.url}: {err}") from err
    nodes = r.json()["nodes"]
    if not nodes:
        print("no node has joined this head")
        return 0
    rows = [["address", "name", "memory GB", "bandwidth GB/s", "in the pipeline", "joined"]]
    for n in nodes:
        rows.append([n["address"], n["name"], f"{n['memory_bytes'] / 1e9:.1f}",
                     f"{n['bandwidth_bytes_per_s'] / 1e9:.1f}", "yes" if n["in_plan"] else "no",
                     time.strftime("%H:%M:%S", time.localtime(n["joined_at"]))])
    print(table(rows))
    return 0
