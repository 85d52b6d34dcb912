"""``mlxpipe nodes``: the nodes a running head knows (its ``/nodes``: joined and found on the
LAN), or, with ``--discover``, what answers on the local network itself."""

from __future__ import annotations

import asyncio
import time

import httpx

from mlxpipe.proto.rpc import Security, add_security_arguments
from mlxpipe.server.cli.options import api_key, table
from mlxpipe.server.cli.running import DEFAULT_URL, head_url
from mlxpipe.shards.net.hello import shown


def get_head(url: str, key: str, path: str):
    """GET ``path`` from the head at ``url`` (given with or without /v1)."""
    r = httpx.get(url.rstrip("/").removesuffix("/v1") + path,
                  headers={"Authorization": f"Bearer {key}"} if key else {}, timeout=10)
    if r.status_code == 401:
        raise ValueError("the head needs an API key: --api-key-file")
    return r


def add_head_arguments(p) -> None:
    """The head to ask, and its key (`mlxpipe nodes`, `mlxpipe status`)."""
    p.add_argument("--url", default=None, help="a running head (default: $MLXPIPE_URL, else the one `mlxpipe serve` "
                                               f"on this machine announced, else {DEFAULT_URL})")
    p.add_argument("--api-key-file", default=None, help="file with the head's API key (or $MLXPIPE_API_KEY)")


def add_arguments(p) -> None:
    add_head_arguments(p)
    p.add_argument("--discover", action="store_true",
                   help="list what answers on the local network (nodes started with `mlxpipe node --announce`): "
                        "with the cluster secret, which are this cluster's and usable, and why the others are not")
    p.add_argument("--wait", type=float, default=3.0, help="with --discover: seconds to listen (default %(default)s)")
    add_security_arguments(p)


def _found_rows(found) -> list:
    """The table of nodes found: every text escaped (``hello.shown``), whoever announced it."""
    rows = [["name", "address", "cluster", "usable", "memory GB", "chip", "mlxpipe", "MLX"]]
    for n in found:
        versions = n.get("versions") or {}
        cells = [n["name"] or n["instance"], n["address"], n["cluster"], "yes" if n["usable"] else f"no: {n['why']}",
                 f"{float(n['memory_bytes']) / 1e9:.1f}", n["chip"][:32], versions.get("mlxpipe", ""),
                 versions.get("mlx", "")]
        rows.append([shown(str(c), 300) for c in cells])
    return rows


async def discover(security: Security, wait: float) -> list:
    """Listen on the LAN for ``wait`` seconds: what was found (``discovery.Found.to_dict``)."""
    from mlxpipe.server.cluster.discovery import Discovery

    found = await Discovery(security).start()
    try:
        await asyncio.sleep(wait)
        while found.checking():  # checks still under way
            await asyncio.sleep(0.1)
        return found.table()
    finally:
        await found.stop()


def run(args) -> int:
    if args.discover:
        found = asyncio.run(discover(Security.from_args(args), args.wait))
        print(table(_found_rows(found)) if found else "no node answered on the local network")
        return 0
    args.url = head_url(args.url)
    try:
        r = get_head(args.url, api_key(args), "/nodes")
    except httpx.HTTPError as err:
        raise ValueError(f"cannot reach the head at {args.url}: {err}") from err
    body = r.json()
    nodes, found = body["nodes"], body.get("discovered", [])
    if not nodes and not found:
        print("no node has joined this head" + (" or been found on the local network" if "discovery" in body else ""))
        return 0
    if nodes:
        rows = [["address", "name", "memory GB", "bandwidth GB/s", "in the pipeline", "joined"]]
        for n in nodes:
            rows.append([n["address"], n["name"], f"{n['memory_bytes'] / 1e9:.1f}",
                         f"{n['bandwidth_bytes_per_s'] / 1e9:.1f}", "yes" if n["in_plan"] else "no",
                         time.strftime("%H:%M:%S", time.localtime(n["joined_at"]))])
        print(table(rows))
    if found:
        drop = body.get("discovery", {}).get("drop_after_s")
        print(("\n" if nodes else "") + f"found on the local network (a node silent for {drop:g} s is dropped):")
        print(table(_found_rows(found)))
    return 0
