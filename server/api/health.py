"""What the head says about itself: ``/health`` (the engine and every stage, 503 with
the reason while anything is not ready), ``/metrics`` (Prometheus, ``metrics.py``)
and ``/nodes`` (the nodes that joined)."""

from __future__ import annotations

from typing import List, Tuple

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from mlxpipe.server.api.metrics import Metrics
from mlxpipe.server.api.options import ApiOptions


def _stage(i: int, st, reply, err: str) -> Tuple[dict, List[str]]:
    """One stage of /health, and why it is not ready (if so)."""
    info = {"stage": i, "address": st.address, "layers": [st.start, st.end]}
    if reply is None:
        info["state"] = "unreachable"
        return info, [f"stage {i} at {st.address} is unreachable: {err}"]
    s = reply.stats
    info.update(state=reply.state, live_sequences=len(reply.live_seqs),
                weight_bytes=reply.weight_bytes, cache_bytes=reply.cache_bytes,
                busy_seconds=s.busy_seconds, uptime_seconds=s.uptime_seconds,
                busy_fraction=s.busy_fraction,
                tokens_per_s=s.tokens_per_s, queue_depth=s.queue_depth,
                frames=s.frames, tokens=s.tokens,
                prefix_cache_bytes=reply.prefix_bytes, prefix_cache_blocks=reply.prefix_blocks,
                prefix_disk_bytes=reply.prefix_disk_bytes, prefix_disk_blocks=reply.prefix_disk_blocks,
                prefix_disk_limit_bytes=reply.prefix_disk_limit,
                prefix_disk_io={"read": s.disk_blocks_read, "written": s.disk_blocks_written,
                                "dropped": s.disk_blocks_dropped},
                prefix_hit_rate=s.reused_tokens / max(s.reused_tokens + s.prefilled_tokens, 1))
    if reply.group_size:  # a tensor-parallel group: its ranks, and what its all-reduces cost a token
        info["group"] = _group(st, reply)
    load = getattr(st, "load", None)  # the stage's Load reply, when the transport keeps it
    if load is not None:
        info["kv_bytes_per_token"] = load.kv_bytes_per_token
    if load is not None and load.memory_warning:  # close to what the Mac's GPU may wire
        info["memory_warning"] = load.memory_warning
    if reply.state != "ready":
        return info, [f"stage {i} at {st.address} is {reply.state}: {reply.detail}"]
    return info, []


def _group(st, reply) -> dict:
    """A stage's tensor-parallel group in /health: its ranks (the leader first) and their state, one
    all-reduce and a token's all-reduces (timed when it loaded), the leader's hand-offs so far."""
    ranks = [{"rank": 0, "address": st.address, "state": reply.state}]
    for r, (address, rh, err) in enumerate(getattr(st, "rank_health", ()), start=1):
        ranks.append({"rank": r, "address": address, "state": rh.state if rh is not None else "unreachable"})
    return {"size": reply.group_size, "ranks": ranks, "allreduce_ms": reply.allreduce_seconds * 1e3,
            "allreduce_ms_per_token": reply.allreduce_seconds * reply.allreduces_per_token * 1e3,
            "handoff_seconds": reply.stats.mirror_seconds, "handoffs": reply.stats.mirrored}


def _cluster(head, keys=("links", "link_warnings", "workload")) -> dict:
    """What the head reports of its cluster beyond the stages (links, the measured workload,
    discovered nodes: ``Cluster.report``), the ``keys`` asked for; nothing from a head without."""
    report = head.report() if hasattr(head, "report") else {}
    return {k: report[k] for k in keys if k in report}


def add_routes(app: FastAPI, head, options: ApiOptions, metrics: Metrics) -> None:
    engine = head.engine

    @app.get("/health")
    async def health():
        reasons = []
        if engine.state != "ready":
            reasons.append(f"pipeline {engine.state}: {engine.failure}")
        stages = []
        for i, (st, reply, err) in enumerate(await engine.health()):
            info, why = _stage(i, st, reply, err)
            stages.append(info)
            reasons += why
        body = {"status": "ok" if not reasons else "unavailable", "model": options.model_id,
                "state": engine.state, "stages": stages, "live_requests": engine.live,
                "recoveries": engine.recoveries, "generated_tokens": engine.generated_tokens,
                "context_length": engine.max_context, "kv_tokens": engine.kv_tokens,
                "speculation": engine.speculation()}
        body.update(_cluster(head))
        if reasons:
            body["reason"] = "; ".join(reasons)
        return JSONResponse(body, status_code=200 if not reasons else 503)

    @app.get("/metrics")
    async def prometheus_metrics():
        stages = await engine.health(timeout=2.0)
        return Response(metrics.render(stages, engine.live, engine.recoveries, engine.drafts, engine.frame_budget(),
                                       _cluster(head).get("links", ())),
                        media_type=CONTENT_TYPE_LATEST)

    @app.get("/nodes")
    async def joined_nodes():
        return {"nodes": head.joined_nodes(), **_cluster(head, ("discovered", "discovery"))}
