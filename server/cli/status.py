"""``mlxpipe status``: the cluster as a table.

From a running head (``--url``, its ``/health``) or straight from the nodes
(``--nodes``, their Health RPC, with the cluster secret).
"""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import List

import httpx

from mlxpipe.proto.rpc import Security, add_security_arguments
from mlxpipe.server.cli.options import api_key, table
from mlxpipe.server.cluster.stage_client import Pipeline


def _mb(n) -> str:
    return f"{(n or 0) / 1e6:.1f}"


def get_head(url: str, key: str, path: str):
    """GET ``path`` from the head at ``url`` (given with or without /v1)."""
    r = httpx.get(url.rstrip("/").removesuffix("/v1") + path,
                  headers={"Authorization": f"Bearer {key}"} if key else {}, timeout=10)
    if r.status_code == 401:
        raise ValueError("the head needs an API key: --api-key-file")
    return r


def from_head(url: str, key: str = "") -> str:
    h = get_head(url, key, "/health").json()
    rows = [["stage", "address", "layers", "state", "weights MB", "KV MB", "busy", "queue", "tok/s", "live"]]
    for s in h.get("stages", []):
        layers = s.get("layers", [0, 0])
        rows.append([str(s["stage"]), s["address"], f"[{layers[0]}, {layers[1]})", s.get("state", "?"),
                     _mb(s.get("weight_bytes")), _mb(s.get("cache_bytes")),
                     f"{s['busy_fraction']:.0%}" if "busy_fraction" in s else "-",
                     str(s.get("queue_depth", "-")), f"{s.get('tokens_per_s', 0):.1f}",
                     str(s.get("live_sequences", "-"))])
    head = (f"{h.get('model')}: {h.get('status')} ({h.get('state', '?')}), {h.get('live_requests', 0)} live "
            f"requests, {h.get('recoveries', 0)} recoveries")
    if h.get("reason"):
        head += f"\n{h['reason']}"
    return head + "\n\n" + table(rows)


async def from_nodes(addresses: List[str], security) -> str:
    pipeline = Pipeline(addresses, "unused", security)
    try:
        health = await pipeline.health(timeout=5)
    finally:
        await pipeline.close()
    rows = [["node", "state", "model", "layers", "weights MB", "KV MB", "RSS MB", "live", "detail"]]
    for st, reply, err in health:
        if reply is None:
            rows.append([st.address, "unreachable", "-", "-", "-", "-", "-", "-", err[:60]])
            continue
        layers = f"[{reply.start}, {reply.end}) of {reply.num_layers}" if reply.num_layers else "-"
        rows.append([st.address, reply.state, Path(reply.model).name or "-", layers, _mb(reply.weight_bytes),
                     _mb(reply.cache_bytes), _mb(reply.rss_bytes), str(len(reply.live_seqs)), reply.detail[:60]])
    return table(rows)


def add_nodes_arguments(p) -> None:
    """The head to ask, and its key (`mlxpipe nodes`; `mlxpipe status` adds its own)."""
    p.add_argument("--url", default="http://127.0.0.1:8000", help="a running head (default http://127.0.0.1:8000)")
    p.add_argument("--api-key-file", default=None, help="file with the head's API key (or $MLXPIPE_API_KEY)")


def add_arguments(p) -> None:
    add_nodes_arguments(p)
    p.add_argument("--nodes", default="", help="ask these nodes (host:port,...) directly instead of a head")
    add_security_arguments(p)
    p.add_argument("--json", action="store_true", help="print the head's /health as JSON")


def run(args) -> int:
    try:
        return _run(args)
    except httpx.HTTPError as err:
        raise ValueError(f"cannot reach the head at {args.url}: {err} (is `mlxpipe serve` running?)") from err


def _run(args) -> int:
    if args.nodes:
        security = Security.from_args(args)
        print(asyncio.run(from_nodes([n.strip() for n in args.nodes.split(",") if n.strip()], security)))
        return 0
    if args.json:
        print(json.dumps(get_head(args.url, api_key(args), "/health").json(), indent=2))
        return 0
    print(from_head(args.url, api_key(args)))
    return 0


def run_nodes(args) -> int:
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
