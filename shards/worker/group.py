"""A stage's tensor-parallel group, as each of its ranks runs it.

A stage may be a group of ranks (processes; on Macs, Macs) that each hold a slice of every
block of the stage's range (``shards/models/tensor_parallel.py``) and all-reduce inside each
block with MLX's own collective, ``mx.distributed``: the ring backend over TCP, or JACCL over
Thunderbolt 5 RDMA where the head found every pair of ranks cabled (``pb.TensorGroup.rdma``,
JACCL's device matrix, as ``mlx.launch`` writes it: ``MLX_IBV_DEVICES`` a file of the matrix,
``MLX_JACCL_COORDINATOR`` rank 0's peer address, ``MLX_RANK``). A node whose MLX has no JACCL
(Linux) refuses a JACCL group before it tries (``check_backend``). gRPC stays the wire between
stages: the group's leader (rank 0) is the stage the head and the neighbours see.

The other ranks run the same ``Shard`` logic on the same inputs. The leader hands them, in
its MLX thread's order, every work item that changes a stage's state (``Mirror``): each
frame it accepted, frees, a new head session's reset, prefix blocks read back from disk; a
``pb.GroupItem`` sent through the group's own collective (its length and first bytes in one
all-reduce, the rest in a second, the others adding zeros). They run each item
(``follow``) and answer nothing: only the leader sends outputs on. Each rank keeps its own
heads' KV and prefix blocks; blocks are usable only where every rank holds them, so the
ranks agree on them at Load and at each read from disk (``common_keys``, ``fetch``).

``mx.distributed.init`` runs once per process: a node joins one group for its life
(``join``). A group whose collective fails (a rank died, a frame failed mid-forward, the
ranks out of step) is broken for good: its ranks leave (``GroupError``), the node restarts,
and the head rebuilds the group as a unit and replays its sequences.

The ring backend's TCP (and JACCL's coordinator) carries no secret and is not encrypted (docs/security.md): the
head names the peers over its authenticated channel, and a dedicated link is advised.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import mlx.core as mx
import numpy as np

from mlxpipe.proto import pipeline_pb2 as pb

logger = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 60.0  # how long a rank waits for the others to connect
FIRST_BYTES = 16 << 10  # an item's first all-reduce: its length and up to this many bytes
BACKENDS = ("ring", "jaccl")  # mx.distributed's: TCP, or RDMA over Thunderbolt 5 (a full mesh of cables)
MAX_RANKS = 64  # ranks in a group, at most (a Load naming more is refused)


class GroupError(RuntimeError):
    """A group that cannot form, or that broke: its ranks leave, and their nodes restart."""


@dataclass(frozen=True)
class Spec:
    """Which rank of which group this node is (``pb.TensorGroup``)."""

    rank: int
    size: int
    peers: Tuple[str, ...]
    backend: str = "ring"
    rdma: Tuple[Tuple[str, ...], ...] = ()  # jaccl: rdma[i][j], the device rank i opens toward rank j

    @classmethod
    def from_wire(cls, group: pb.TensorGroup) -> "Spec":
        """The spec a Load names; ValueError (INVALID_ARGUMENT) for one that cannot be."""
        spec = cls(group.rank, group.size, tuple(group.peers), group.backend or "ring",
                   tuple(tuple(row.to) for row in group.rdma))
        if not 2 <= spec.size <= MAX_RANKS or not 0 <= spec.rank < spec.size or len(spec.peers) != spec.size:
            raise ValueError(f"tensor group: rank {spec.rank} of {spec.size} with {len(spec.peers)} peers")
        if spec.backend not in BACKENDS:
            raise ValueError(f"tensor group: backend {spec.backend!r} is none of {', '.join(BACKENDS)}")
        if any(p.count(":") < 1 for p in spec.peers):
            raise ValueError("tensor group: every peer is host:port")
        if spec.backend == "jaccl":
            why = mesh_gaps(spec.rdma, spec.size)
            if why:
                raise ValueError(f"tensor group: JACCL's device matrix {why}")
        return spec

    @property
    def leader(self) -> bool:
        return self.rank == 0


_joined: Optional[Tuple[Spec, object]] = None  # this process's group (mx.distributed.init runs once)


def joined() -> Optional[Spec]:
    return _joined[0] if _joined is not None else None


def join(spec: Spec, timeout_s: float = JOIN_TIMEOUT_S):
    """This process's collective for ``spec`` (MLX thread): made once; the same spec again
    gets the same group, another one ``GroupError`` (the node must restart first)."""
    global _joined
    if _joined is not None:
        if _joined[0] == spec:
            return _joined[1]
        raise GroupError(f"this node is rank {_joined[0].rank} of another group ({', '.join(_joined[0].peers)}); "
                         "it restarts before it joins a new one")
    check_backend(spec.backend)
    env, hostfile = backend_env(spec)
    os.environ.update(env)
    made: list = []
    # The ring waits for its peers without a deadline: on a thread of its own, given up after timeout_s.
    thread = threading.Thread(target=lambda: made.append(_init(spec.backend)), name="group-init", daemon=True)
    thread.start()
    thread.join(timeout_s)
    os.unlink(hostfile)
    if not made or isinstance(made[0], Exception):
        why = made[0] if made else f"the other ranks did not connect within {timeout_s:.0f}s"
        _joined = (Spec(-1, 0, ()), None)  # half-made: never again in this process
        raise GroupError(f"rank {spec.rank} of {spec.size} could not join its group at {spec.peers[spec.rank]}: "
                         f"{why}")
    group = made[0]
    if (group.rank(), group.size()) != (spec.rank, spec.size):
        raise GroupError(f"MLX made rank {group.rank()} of {group.size()}, not {spec.rank} of {spec.size}")
    _joined = (spec, group)
    logger.info("joined a %s group as rank %d of %d (%s)", spec.backend, spec.rank, spec.size, ", ".join(spec.peers))
    return group


def mesh_gaps(rdma: Sequence[Sequence[str]], size: int) -> str:
    """What keeps ``rdma`` from being JACCL's full mesh among ``size`` ranks ("" when nothing does)."""
    if len(rdma) != size or any(len(row) != size for row in rdma):
        return f"is not {size} by {size}"
    if any(rdma[i][i] for i in range(size)):
        return "names a device from a rank to itself"
    gaps = [f"{i}->{j}" for i in range(size) for j in range(size) if i != j and not rdma[i][j]]
    return f"names no device for ranks {', '.join(gaps[:4])}" if gaps else ""


def check_backend(backend: str) -> None:
    """ValueError (the Load's INVALID_ARGUMENT; the node stays as it was), one line, when this
    node's MLX cannot make ``backend``'s groups at all (JACCL on Linux, or a Mac without RDMA)."""
    if not mx.distributed.is_available(backend):
        hint = (f" (JACCL is RDMA over Thunderbolt 5: a Mac with RDMA enabled; this is {platform.system()})"
                if backend == "jaccl" else "")
        raise ValueError(f"tensor group: this node's MLX {mx.__version__} has no {backend} backend{hint}; "
                         "start the head with --tp-backend ring")


def backend_env(spec: Spec) -> Tuple[dict, str]:
    """The environment MLX's backend reads at init (as ``mlx.launch`` sets it), and the file it
    names (removed once the group is made): the ring's hostfile, one address per rank, or JACCL's
    device matrix (an entry with several devices, comma-separated on the wire, a list), whose
    coordinator is rank 0's peer address."""
    if spec.backend == "jaccl":
        content = [[None if i == j else (d.split(",") if "," in d else d) for j, d in enumerate(row)]
                   for i, row in enumerate(spec.rdma)]
    else:
        content = [[peer] for peer in spec.peers]
    fd, path = tempfile.mkstemp(prefix=f"mlxpipe-{spec.backend}-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(content, f)
    if spec.backend == "jaccl":
        return {"MLX_RANK": str(spec.rank), "MLX_IBV_DEVICES": path, "MLX_JACCL_COORDINATOR": spec.peers[0]}, path
    return {"MLX_RANK": str(spec.rank), "MLX_HOSTFILE": path}, path


def _init(backend: str):
    try:
        return mx.distributed.init(backend=backend, strict=True)
    except Exception as err:  # noqa: BLE001 - reported by join
        return err


def agree(group, ok: bool) -> bool:
    """Whether every rank says ``ok`` (each rank calls it at the same point)."""
    failed = mx.distributed.all_sum(mx.array([0 if ok else 1], dtype=mx.int32), group=group, stream=mx.cpu)
    return failed.item() == 0


def common_keys(group, keys: Sequence[int]) -> set:
    """The keys every rank holds (of ``keys``, this rank's)."""
    most = mx.distributed.all_max(mx.array([len(keys)], dtype=mx.int32), group=group, stream=mx.cpu).item()
    if most == 0:
        return set()
    mine = np.zeros(most + 1, dtype=np.uint64)  # the count first, then the keys
    mine[0], mine[1:len(keys) + 1] = len(keys), keys
    every = np.array(mx.distributed.all_gather(mx.array(mine), group=group, stream=mx.cpu)).reshape(-1, most + 1)
    sets = [set(row[1:1 + int(row[0])].tolist()) for row in every]
    return set.intersection(*sets)


def time_allreduce(group, hidden_size: int, repeats: int = 20) -> float:
    """Seconds one all-reduce of a token's hidden state (float32) takes among the group, median."""
    x = mx.ones((1, hidden_size), dtype=mx.float32)
    mx.eval(mx.distributed.all_sum(x, group=group))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        mx.eval(mx.distributed.all_sum(x, group=group))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


# -- the leader hands its work on, the others follow ----------------------------------------


def _share(group, data: bytes) -> bytes:
    """All-reduce ``data`` (the leader's; the others pass b"" and get it back): its length and
    first bytes in one all-reduce, the rest, if any, in a second."""
    head = np.zeros(8 + FIRST_BYTES, dtype=np.uint8)
    head[:8] = np.frombuffer(np.array([len(data)], dtype="<u8").tobytes(), dtype=np.uint8)
    first = data[:FIRST_BYTES]
    head[8:8 + len(first)] = np.frombuffer(first, dtype=np.uint8)
    got = np.array(mx.distributed.all_sum(mx.array(head), group=group, stream=mx.cpu))
    n = int(np.frombuffer(got[:8].tobytes(), dtype="<u8")[0])
    out = got[8:8 + min(n, FIRST_BYTES)].tobytes()
    if n > FIRST_BYTES:
        rest = np.zeros(n - FIRST_BYTES, dtype=np.uint8)
        if data:
            rest[:] = np.frombuffer(data[FIRST_BYTES:], dtype=np.uint8)
        out += np.array(mx.distributed.all_sum(mx.array(rest), group=group, stream=mx.cpu)).tobytes()
    return out


class Mirror:
    """The leader's side: every state-changing work item, handed to the other ranks (MLX thread)."""

    def __init__(self, group):
        self.group = group
        self.seconds, self.count = 0.0, 0  # time spent handing items on, and how many
        self.broken = lambda why: None  # told when a hand-off fails, whoever asked for it (the servicer restarts)

    def send(self, item: pb.GroupItem) -> None:
        t0 = time.perf_counter()
        try:
            _share(self.group, item.SerializeToString())
        except RuntimeError as err:  # the collective failed: a rank is gone
            self.broken(f"the group's other ranks are gone: {err}")
            raise GroupError(f"the group's other ranks are gone: {err}") from err
        self.seconds += time.perf_counter() - t0
        self.count += 1

    def frame(self, frame: pb.Frame, session: int) -> None:
        self.send(pb.GroupItem(kind=pb.GroupItem.FRAME, frame=frame, session=session))

    def free(self, seq_ids: Sequence[int]) -> None:
        self.send(pb.GroupItem(kind=pb.GroupItem.FREE, seq_ids=seq_ids))

    def free_session(self, session: int) -> None:
        self.send(pb.GroupItem(kind=pb.GroupItem.FREE_SESSION, session=session))

    def free_all(self) -> None:
        self.send(pb.GroupItem(kind=pb.GroupItem.FREE_ALL))

    def stop(self) -> None:
        self.send(pb.GroupItem(kind=pb.GroupItem.STOP))

    def beat(self) -> None:
        self.send(pb.GroupItem(kind=pb.GroupItem.BEAT))

    def fetch(self, prefix, request: pb.FetchRequest) -> Tuple[List[int], List[int]]:
        """A ``Fetch`` on every rank at once (``fetch``)."""
        self.send(pb.GroupItem(kind=pb.GroupItem.FETCH, fetch=request))
        return fetch(self.group, prefix, request.seq_id, list(request.keys))


def fetch(group, prefix, seq_id: int, keys: Sequence[int]) -> Tuple[List[int], List[int]]:
    """Every rank reads a sequence's blocks back from its own disk; they keep the run all of
    them read, and drop from disk what any of them lacks. (loaded, dropped), the same on all."""
    loaded, dropped = prefix.fetch(seq_id, list(keys))
    least = mx.distributed.all_min(mx.array([len(loaded)], dtype=mx.int32), group=group, stream=mx.cpu).item()
    lacking = mx.array([1 if k in set(dropped) else 0 for k in keys] or [0], dtype=mx.int32)
    lacking = np.array(mx.distributed.all_sum(lacking, group=group, stream=mx.cpu))
    gone = [k for k, n in zip(keys, lacking) if n]
    prefix.staged[seq_id] = {k: prefix.staged.get(seq_id, {})[k] for k in loaded[:least]}
    if gone:
        prefix.discard(gone)
    return list(loaded[:least]), gone


def follow(group, shard, stopped: threading.Event) -> None:
    """A rank other than the leader: run the leader's work items until it says stop (MLX thread).
    Raises ``GroupError`` when the group breaks: out of step with the leader, it can only leave."""
    while True:
        try:
            item = pb.GroupItem.FromString(_share(group, b""))
        except RuntimeError as err:
            raise GroupError(f"the group's leader is gone: {err}") from err
        if item.kind == pb.GroupItem.STOP:
            stopped.set()
            return
        try:
            _run(group, shard, item)
        except Exception as err:  # noqa: BLE001 - any failure leaves this rank out of step
            raise GroupError(f"rank could not follow its leader ({pb.GroupItem.Kind.Name(item.kind)}): "
                             f"{type(err).__name__}: {err}") from err


def _run(group, shard, item: pb.GroupItem) -> None:
    kind = item.kind
    if kind == pb.GroupItem.FRAME:
        launched = shard.launch(item.frame, item.session)
        if isinstance(launched.out, mx.array):
            mx.eval(launched.out)
        launched.drop()
    elif kind == pb.GroupItem.FREE:
        shard.free_and_publish(list(item.seq_ids))
    elif kind == pb.GroupItem.FREE_SESSION:
        shard.free_session(item.session)
    elif kind == pb.GroupItem.FREE_ALL:
        shard.free_all()
    elif kind == pb.GroupItem.FETCH:
        fetch(group, shard.prefix, item.fetch.seq_id, list(item.fetch.keys))
