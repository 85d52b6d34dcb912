"""What the head says about itself: ``/health`` (the engine and every stage, 503 with
the reason while anything is not ready), ``/metrics`` (Prometheus, ``metrics.py``)
and ``/nodes`` (the nodes that joined).

An operator (``keys.KeyPolicy``; everyone on a server without keys) sees it all. A
key that is not an operator's sees no other key's activity: /health gives each
stage's place and state, and of the requests only the key's own (``KeyMeter``);
/metrics gives the key's own counters alone."""

from __future__ import annotations

from typing import List, Tuple

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from mlxpipe.server.api.keys import caller_of
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


# What a stage's entry in /health shows a key that is not an operator's: where it is and whether it serves.
USER_STAGE_FIELDS = ("stage", "address", "layers", "state", "weight_bytes", "kv_bytes_per_token")


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
    async def health(request: Request):
        caller = caller_of(request)
        reasons = []
        if engine.state != "ready":
            reasons.append(f"pipeline {engine.state}: {engine.failure}")
        stages = []
        for i, (st, reply, err) in enumerate(await engine.health()):
            info, why = _stage(i, st, reply, err)
            stages.append(info if caller.operator else {k: v for k, v in info.items() if k in USER_STAGE_FIELDS})
            reasons += why
        body = {"status": "ok" if not reasons else "unavailable", "model": options.model_id,
                "state": engine.state, "stages": stages, "recoveries": engine.recoveries,
                "context_length": engine.max_context, "kv_tokens": engine.kv_tokens}
        if caller.operator:
            body.update(live_requests=engine.live, generated_tokens=engine.generated_tokens,
                        speculation=engine.speculation(), **_cluster(head))
            if getattr(head, "extras", None):
                body["head_models"] = [m.as_dict() for m in head.extras]
            if getattr(head, "vision", None) is not None:  # a vision model: its tower on the head, measured
                body["vision"] = head.vision.report()
        else:  # its own
            meter = metrics.key(caller.identity)
            body.update(live_requests=meter.live, generated_tokens=meter.generated)
        if getattr(head, "embedder", None) is not None:
            body["embedding_model"] = head.embedder.as_dict() if caller.operator else {
                "name": head.embedder.facts.name, "dimensions": head.embedder.facts.dimensions}
        if reasons:
            body["reason"] = "; ".join(reasons)
        return JSONResponse(body, status_code=200 if not reasons else 503)

    @app.get("/metrics")
    async def prometheus_metrics(request: Request):
        caller = caller_of(request)
        if not caller.operator:
            return Response(metrics.key(caller.identity).render(), media_type=CONTENT_TYPE_LATEST)
        stages = await engine.health(timeout=2.0)
        return Response(metrics.render(stages, engine.live, engine.recoveries, engine.drafts, engine.frame_budget(),
                                       _cluster(head).get("links", ()), getattr(head, "embedder", None)),
                        media_type=CONTENT_TYPE_LATEST)

    @app.get("/nodes")
    async def joined_nodes():
        return {"nodes": head.joined_nodes(), **_cluster(head, ("discovered", "discovery"))}
