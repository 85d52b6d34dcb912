"""``mlxpipe status``: the cluster as a table.

From a running head (``--url``, its ``/health``) or straight from the nodes
(``--nodes``, their Health RPC, with the cluster secret).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import List

import httpx

from mlxpipe.proto.rpc import Security, add_security_arguments
from mlxpipe.server.cli.nodes import add_head_arguments, get_head
from mlxpipe.server.cli.options import api_key, table
from mlxpipe.server.cli.running import head_url


def _mb(n) -> str:
    return f"{(n or 0) / 1e6:.1f}"


def _disk(s: dict) -> str:
    """A stage's disk tier: the prefix blocks on it, of what it may hold."""
    if not s.get("prefix_disk_limit_bytes"):
        return "off" if "prefix_disk_limit_bytes" in s else "-"
    return f"{_mb(s.get('prefix_disk_bytes'))} of {_mb(s['prefix_disk_limit_bytes'])}"


def from_head(url: str, key: str = "") -> str:
    h = get_head(url, key, "/health").json()
    rows = [["stage", "address", "layers", "state", "weights MB", "KV MB", "prefix MB", "disk MB", "busy", "queue",
             "tok/s", "live"]]
    for s in h.get("stages", []):
        layers = s.get("layers", [0, 0])
        rows.append([str(s["stage"]), s["address"], f"[{layers[0]}, {layers[1]})", s.get("state", "?"),
                     _mb(s.get("weight_bytes")), _mb(s.get("cache_bytes")), _mb(s.get("prefix_cache_bytes")),
                     _disk(s),
                     f"{s['busy_fraction']:.0%}" if "busy_fraction" in s else "-",
                     str(s.get("queue_depth", "-")), f"{s['tokens_per_s']:.1f}" if "tokens_per_s" in s else "-",
                     str(s.get("live_sequences", "-"))])
    head = (f"{h.get('model')}: {h.get('status')} ({h.get('state', '?')}), {h.get('live_requests', 0)} live "
            f"requests, {h.get('recoveries', 0)} recoveries")
    if h.get("context_length"):
        head += (f"\ncontext: {h['context_length']} tokens per request; the KV cache holds {h.get('kv_tokens')} "
                 "tokens in all requests at once")
    if h.get("reason"):
        head += f"\n{h['reason']}"
    head += _speculation(h.get("speculation") or {})
    warnings = [f"stage {s['stage']}: {s['memory_warning']}" for s in h.get("stages", []) if s.get("memory_warning")]
    warnings += h.get("link_warnings", [])
    return head + "\n\n" + table(rows) + _groups(h) + _links(h) + _workload(h) + "".join(f"\n{w}" for w in warnings)


def _groups(h: dict) -> str:
    """Each stage that is a tensor-parallel group: its ranks and what its all-reduces cost a token."""
    lines = []
    for s in h.get("stages", []):
        g = s.get("group")
        if g:
            ranks = ", ".join(f"{r['rank']} {r['address']} {r['state']}" for r in g["ranks"])
            lines.append(f"stage {s['stage']}: a group of {g['size']} ranks ({ranks}); all-reduces "
                         f"{g['allreduce_ms_per_token']:.2f} ms a token ({g['allreduce_ms']:.3f} ms each)")
    return "\n\n" + "\n".join(lines) if lines else ""


def _speculation(spec: dict) -> str:
    """Drafts judged and accepted, per source; whether the model's MTP head drafts."""
    mtp = spec.get("mtp") or {}
    line = "\nspeculation: " + (", ".join(f"{source} {row['accepted_tokens']} of {row['drafted_tokens']} accepted"
                                          for source, row in sorted((spec.get("by_source") or {}).items()))
                                or "no drafts judged yet")
    if mtp.get("loaded"):
        line += "; the model's MTP head drafts"
    elif mtp.get("note"):
        line += f"; no MTP head ({mtp['note']})"
    return line


def _links(h: dict) -> str:
    """Every link's latency and throughput (the head's /health ``links``)."""
    if not h.get("links"):
        return ""
    rows = [["link", "from", "to", "latency ms", "MB/s", "jitter ms", "from what"]]
    for l in h["links"]:
        rows.append([l["name"], l["source"], l["target"], f"{l['latency_s'] * 1e3:.2f}",
                     f"{l['bytes_per_s'] / 1e6:.1f}" if l["bytes_per_s"] else "-", f"{l['jitter_s'] * 1e3:.2f}",
                     l["basis"]])
    return "\n\n" + table(rows, right=range(3, 6))


def _workload(h: dict) -> str:
    """The workload the head measured, the split it implies and what that would gain."""
    w = h.get("workload")
    if not w:
        return ""
    return "\n\n" + "\n".join(w.get("lines", []))


async def from_nodes(addresses: List[str], security) -> str:
    from mlxpipe.server.cluster.stage_client import Pipeline  # (deferred: gRPC and MLX, seconds to import)

    pipeline = Pipeline(addresses, "unused", security)
    try:
        health = await pipeline.health(timeout=5)
    finally:
        await pipeline.close()
    rows = [["node", "state", "model", "layers", "weights MB", "KV MB", "prefix MB", "disk MB", "RSS MB", "live",
             "detail"]]
    for st, reply, err in health:
        if reply is None:
            rows.append([st.address, "unreachable", "-", "-", "-", "-", "-", "-", "-", "-", err[:60]])
            continue
        layers = f"[{reply.start}, {reply.end}) of {reply.num_layers}" if reply.num_layers else "-"
        disk = _disk({"prefix_disk_bytes": reply.prefix_disk_bytes, "prefix_disk_limit_bytes": reply.prefix_disk_limit})
        rows.append([st.address, reply.state, Path(reply.model).name or "-", layers, _mb(reply.weight_bytes),
                     _mb(reply.cache_bytes), _mb(reply.prefix_bytes), disk, _mb(reply.rss_bytes),
                     str(len(reply.live_seqs)), reply.detail[:60]])
    return table(rows)


def add_arguments(p) -> None:
    add_head_arguments(p)
    p.add_argument("--nodes", default="", help="ask these nodes (host:port,...) directly instead of a head")
    add_security_arguments(p)
    p.add_argument("--json", action="store_true", help="print the head's /health as JSON")


def run(args) -> int:
    args.url = head_url(args.url)
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
