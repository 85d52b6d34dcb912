"""Nodes that join: the head's side of ``mlxpipe node --join HEAD:PORT``.

The head runs a small gRPC service (``Head.Join``, behind the same cluster
secret as every node). A node that joins (``shards/worker/node.py`` dials in) offers
its address, memory and measured bandwidth; the head adds it to the nodes it
plans over and re-plans (live sequences pause and replay, as after a fault).
``mlxpipe nodes`` lists who joined. Manual ``--nodes`` always works too; no
multicast is involved.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Dict

import grpc

from mlxpipe.proto import pipeline_pb2 as pb
from mlxpipe.proto import pipeline_pb2_grpc as pb_grpc
from mlxpipe.proto.rpc import Security, head_server, refuse_malformed

logger = logging.getLogger(__name__)


@dataclass
class Joined:
    address: str
    name: str
    memory_bytes: int
    bandwidth_bytes_per_s: float
    joined_at: float = field(default_factory=time.time)


class HeadService(pb_grpc.HeadServicer):
    def __init__(self, cluster):
        self.cluster = cluster

    async def Join(self, request: pb.JoinRequest, context):
        await refuse_malformed(request, context)
        if ":" not in request.address:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "address must be host:port")
        joined = Joined(request.address, request.name or request.address, request.memory_bytes,
                        request.bandwidth_bytes_per_s)
        logger.warning("node %s (%s) joins with %.1f GB", joined.name, joined.address, joined.memory_bytes / 1e9)
        in_plan, detail = await self.cluster.add_node(joined)
        return pb.JoinReply(model=str(self.cluster.config.model), in_plan=in_plan, detail=detail)


async def start_join_server(cluster, listen: str, security: Security) -> grpc.aio.Server:
    server = head_server(HeadService(cluster), security)
    if security.add_port(server, listen) == 0:
        raise SystemExit(f"cannot listen for joining nodes on {listen}")
    await server.start()
    return server


def joined_table(nodes: Dict[str, Joined], in_plan) -> list:
    return [{"address": j.address, "name": j.name, "memory_bytes": j.memory_bytes,
             "bandwidth_bytes_per_s": j.bandwidth_bytes_per_s, "joined_at": j.joined_at,
             "in_plan": j.address in in_plan} for j in nodes.values()]
