"""Nodes refused early, each with a one-line reason: another mlxpipe, MLX or mlx-lm than
the head's, a clock far from the head's, no proof of the cluster secret (a node that
was discovered rather than named). (A copy of the model that is not the head's is
never loaded: the node receives the head's units, ``weights.py``, and a node that loaded
another is refused when the stages load, ``stage_client.py``; less memory than a stage
needs, by the stage itself before it reads a byte, ``shards/worker/memory.py``.)

The head asks every node ``Hello`` (``shards/net/hello.py``) before it plans: the reply
says what the node runs and, for a node that holds the secret, proves it does.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass
from typing import Dict, Optional, Sequence

import grpc

from mlxpipe.proto import pipeline_pb2 as pb
from mlxpipe.proto import pipeline_pb2_grpc as pb_grpc
from mlxpipe.proto.rpc import Security
from mlxpipe.shards.net import hello

MAX_CLOCK_SKEW_S = 30.0  # a node whose clock is further from the head's is refused


@dataclass
class NodeFacts:
    """What a node says of itself in ``Hello``, and what the head made of it."""

    address: str
    reply: pb.HelloReply
    proved: bool            # it proved it holds this head's secret
    clock_offset_s: float   # its clock less the head's, at the middle of the round trip

    @property
    def versions(self) -> Dict[str, str]:
        r = self.reply
        return {"mlxpipe": r.mlxpipe_version, "mlx": r.mlx_version, "mlx_lm": r.mlx_lm_version}


async def ask(address: str, security: Security, timeout: float = 3.0,
              channel: Optional[grpc.aio.Channel] = None) -> NodeFacts:
    """``Hello`` to ``address`` (on a fresh channel, or ``channel``): ConnectionError saying why
    when it does not answer. It carries a fresh nonce and the address, nothing of the secret."""
    if channel is None:
        async with security.channel(address) as fresh:
            return await ask(address, security, timeout, fresh)
    nonce = secrets.token_bytes(16)
    md = ((hello.NONCE_KEY, nonce.hex()), (hello.DIALLED_KEY, address))
    t0 = time.time()
    try:
        reply = await pb_grpc.StageStub(channel).Hello(pb.HelloRequest(), timeout=timeout, metadata=md)
    except grpc.aio.AioRpcError as err:
        if err.code() == grpc.StatusCode.UNIMPLEMENTED:
            raise ConnectionError(f"node {address} runs an older mlxpipe than this head (it has no Hello): "
                                  "install the same version") from None
        raise ConnectionError(f"node {address} does not answer: {err.code().name}: "
                              f"{hello.shown(err.details() or '', 200)}") from None
    t1 = time.time()
    proved = bool(security.secret) and hello.verify(security.secret, nonce, address, reply.proof)
    return NodeFacts(address, reply, proved, reply.time_s - (t0 + t1) / 2)


def refusal(facts: NodeFacts, need_proof: bool) -> Optional[str]:
    """Why this head will not use the node (one line), or None."""
    mine, theirs = hello.versions(), facts.versions
    if need_proof and not facts.proved:
        return f"node {facts.address} does not prove it holds this cluster's secret"
    differ = [k for k in ("mlxpipe", "mlx", "mlx_lm") if mine[k] != theirs[k]]
    if differ:
        names = {"mlxpipe": "mlxpipe", "mlx": "MLX", "mlx_lm": "mlx-lm"}
        said = ", ".join(f"{names[k]} {hello.shown(theirs[k], 40) or '?'}" for k in differ)
        head = ", ".join(f"{names[k]} {mine[k]}" for k in differ)
        return f"node {facts.address} runs {said}, this head {head}: install the same versions"
    if abs(facts.clock_offset_s) > MAX_CLOCK_SKEW_S:
        return (f"node {facts.address}'s clock is {facts.clock_offset_s:+.0f} s from this head's (more than "
                f"{MAX_CLOCK_SKEW_S:.0f} s): set both by network time")
    return None


async def vet(addresses: Sequence[str], security: Security, need_proof: bool = False) -> Dict[str, Optional[str]]:
    """Every node's refusal (None: usable), asked at once."""
    async def one(a: str) -> Optional[str]:
        try:
            return refusal(await ask(a, security), need_proof)
        except ConnectionError as err:
            return str(err)

    return dict(zip(addresses, await asyncio.gather(*(one(a) for a in addresses))))

