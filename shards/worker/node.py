"""``mlxpipe node``: a stage's gRPC server on this machine, and its way to a head.

A head drives the node (``servicer.py``); with ``--join HEAD:PORT`` the node
also offers itself to a head that listens for nodes (``mlxpipe serve
--join-listen``). A head's local stages are nodes too, started with
``--exit-with-parent``.

    python -m mlxpipe.shards.worker.node --listen 127.0.0.1:50051
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import platform
import signal
import socket
import sys
from pathlib import Path
from typing import Optional

import grpc

from mlxpipe.proto import pipeline_pb2 as pb
from mlxpipe.proto import pipeline_pb2_grpc as pb_grpc
from mlxpipe.proto.rpc import (REPLAN_WAIT_S, SECRET_ENV, Security, add_security_arguments, raise_fd_limit,
                               stage_server)
from mlxpipe.shards.net import rdma
from mlxpipe.shards.params.kv import (DEFAULT_KV_GROUP_SIZE, DEFAULT_QUANTIZED_KV_START, KV_BITS_HELP,
                                     KV_GROUP_SIZE_HELP, KV_START_HELP, KvQuant)
from mlxpipe.shards.params.quant import KV_BITS
from mlxpipe.shards.params.sizes import parse_size
from mlxpipe.shards.worker.node_options import add_launch_ahead

logger = logging.getLogger(__name__)


async def _exit_with_parent(stop) -> None:
    """Stop (``stop(0)``) when the process that started us is gone (a head killed
    with -9 must not leave stage processes behind)."""
    parent = os.getppid()
    while os.getppid() == parent:
        await asyncio.sleep(1.0)
    logger.warning("parent process %d is gone; stopping", parent)
    stop(0)


async def _stop(server, servicer, code: int, announcer=None) -> None:
    """SIGINT/SIGTERM, or the parent gone: say goodbye on the LAN, end every call with a
    status, finish the prefix cache's disk writes, then leave at once (the exit code the
    shell expects): interpreter teardown under MLX's and gRPC's threads can only abort
    noisily ("terminate called without an active exception")."""
    if announcer is not None:
        try:
            await asyncio.wait_for(announcer.stop(), 2.0)
        except Exception as err:  # noqa: BLE001 - leaving anyway; the records expire by themselves
            logger.info("goodbye on the LAN failed: %s", err)
    await server.stop(grace=1.0)
    await asyncio.to_thread(servicer.close)
    logging.shutdown()
    os._exit(code)


async def join_head(head: str, address: str, name: str, memory_bytes: int, bandwidth: float,
                    security: Security, attempts: int = 60) -> pb.JoinReply:
    """Dial the head until it answers; raise PermissionError when it refuses our secret."""
    last = None
    for _ in range(attempts):
        async with security.channel(head) as channel:
            try:
                return await pb_grpc.HeadStub(channel).Join(
                    pb.JoinRequest(address=address, name=name, memory_bytes=memory_bytes,
                                   bandwidth_bytes_per_s=bandwidth),
                    timeout=REPLAN_WAIT_S, metadata=security.metadata())
            except grpc.aio.AioRpcError as err:
                if err.code() == grpc.StatusCode.UNAUTHENTICATED:
                    raise PermissionError(f"the head at {head} refused this node: {err.details()}") from err
                last = err
        await asyncio.sleep(2.0)
    raise ConnectionError(f"the head at {head} did not answer: {last.details() if last else ''}")


async def _join_or_exit(head: str, address: str, security: Security, memory_bytes: Optional[int]) -> None:
    """Offer ourselves to the head; stop the node if it refuses our secret."""
    from mlxpipe.shards.models.profile import memory_bandwidth, offered_memory

    memory = offered_memory(memory_bytes)
    bandwidth = await asyncio.to_thread(memory_bandwidth)
    try:
        reply = await join_head(head, address, platform.node(), memory, bandwidth, security)
    except (PermissionError, ConnectionError) as err:
        print(f"mlxpipe node: {err}", file=sys.stderr, flush=True)
        os._exit(1)  # a node the head will not have is of no use
    logger.warning("joined the head at %s (%s): %s", head, "in the pipeline" if reply.in_plan else "standing by",
                   reply.detail)


def free_port(host: str) -> int:
    """A port free on ``host`` now (for a tensor group's collective, which binds it later)."""
    with socket.socket(socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET) as s:
        s.bind((host.strip("[]") or "0.0.0.0", 0))
        return s.getsockname()[1]


def _restart_in_place(host: str, port: int) -> None:
    """Start this node afresh in this process, on the port it has (its tensor group broke, and
    ``mx.distributed.init`` runs once per process): the ring's sockets and the server's close
    with the old image; a head sees the node answer again within seconds."""
    argv = [sys.executable, *sys.orig_argv[1:]]
    for i, arg in enumerate(argv):
        if arg == "--listen" and i + 1 < len(argv):
            argv[i + 1] = f"{host}:{port}"
        elif arg.startswith("--listen="):
            argv[i] = f"--listen={host}:{port}"
    logging.shutdown()
    os.closerange(3, os.sysconf("SC_OPEN_MAX") if hasattr(os, "sysconf") else 4096)
    os.execv(sys.executable, argv)


def _advertised(listen: str, head: str) -> str:
    """The address the head should use for us: ours on the route toward the head."""
    host, _, port = listen.rpartition(":")
    if host not in ("0.0.0.0", "::", "[::]", ""):
        return listen
    head_host, _, head_port = head.rpartition(":")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((head_host, int(head_port)))
        return f"{s.getsockname()[0]}:{port}"


async def _announce(servicer, host: str, port: int, advertise: Optional[str], memory_bytes: Optional[int]):
    """Announce this node on the LAN (``announce.py``); None, saying why, where it cannot."""
    from mlxpipe.shards.net.announce import Announcer, addresses, properties
    from mlxpipe.shards.models.profile import offered_memory

    if advertise:
        host, _, given = advertise.rpartition(":")
        port = int(given)
    try:
        announcer = Announcer(servicer.name, addresses(host), port,
                              properties(servicer.name, offered_memory(memory_bytes), servicer.security.secret))
        await announcer.start()
    except Exception as err:  # noqa: BLE001 - zeroconf's own errors too: the node serves all the same
        logger.error("cannot announce this node on the local network: %s: %s", type(err).__name__, err)
        return None
    return announcer


async def serve(listen: str, security: Optional[Security] = None, memory_bytes: Optional[int] = None,
                models_dir: Optional[Path] = None, exit_with_parent: bool = False,
                join: Optional[str] = None, advertise: Optional[str] = None,
                launch_ahead: Optional[bool] = None, announce: bool = False, name: Optional[str] = None,
                kv: Optional[KvQuant] = None, disk_bytes: Optional[int] = None, group_port: int = 0) -> None:
    """Run a stage server on ``listen`` (host:port; port 0 picks a free one); ``announce``: on the LAN."""
    security = security or Security()
    raise_fd_limit()  # every connection, a stranger's half-open one too, holds a descriptor
    # A node shows progress (bars in a terminal, lines in a log); stages a head started stay quiet.
    from mlxpipe.shards.worker.servicer import StageServicer  # (MLX and mlx-lm: `node --help` needs neither)

    servicer = StageServicer(security, memory_bytes, models_dir, progress=not exit_with_parent,
                             launch_ahead=launch_ahead, kv=kv, disk_bytes=disk_bytes)
    servicer.name = name or servicer.name
    rdma.ports()  # read once, before the first Hello asks (macOS's Thunderbolt report takes a moment)
    server = stage_server(servicer, security)
    host, _, port = listen.rpartition(":")
    bound = security.add_port(server, f"{host}:{port}")
    if bound == 0:
        raise SystemExit(f"cannot listen on {listen}")
    await server.start()
    servicer.listening = (bound, advertise or "")
    servicer.group_port = group_port or free_port(host)
    servicer.restart = lambda: _restart_in_place(host, bound)
    announcer = None  # (set below: stop() reads it when it runs)
    stopping = []  # the stop under way, which main awaits: returning first would start the noisy teardown

    def stop(code: int) -> None:
        if not stopping:
            stopping.append(asyncio.ensure_future(_stop(server, servicer, code, announcer)))

    loop = asyncio.get_running_loop()
    for sig, code in ((signal.SIGINT, 130), (signal.SIGTERM, 143)):  # before anyone knows our address
        loop.add_signal_handler(sig, stop, code)
    # The one line a parent process waits for to learn the address.
    print(f"mlxpipe node listening on {host}:{bound}", flush=True)
    logger.info("stage listening on %s:%d (%s, %s)", host, bound,
                "secret required" if security.secret else "no secret",
                "mutual TLS" if security.cert and security.ca else "TLS" if security.cert else "no TLS")
    if announce:
        announcer = await _announce(servicer, host, bound, advertise, memory_bytes)
    watcher = asyncio.ensure_future(_exit_with_parent(stop)) if exit_with_parent else None
    joiner = None
    if join:
        address = advertise or _advertised(f"{host}:{bound}", join)
        joiner = asyncio.ensure_future(_join_or_exit(join, address, security, memory_bytes))
    await server.wait_for_termination()
    if stopping:
        await stopping[0]  # it leaves the process with os._exit
    for task in (watcher, joiner):
        if task is not None:
            task.cancel()


def _loopback(host: str) -> bool:
    return host in ("127.0.0.1", "::1", "[::1]", "localhost") or host.startswith("127.")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--listen", default=None,
                        help="host:port to listen on (default 127.0.0.1:50051, or 0.0.0.0:50051 with --announce; "
                             "port 0 picks one). Any other host than loopback needs the cluster secret.")
    parser.add_argument("--name", default=None, help="what heads call this node (default: the host name)")
    parser.add_argument("--announce", action="store_true",
                        help="announce this node on the local network (DNS-SD), with its cluster id (derived from "
                             "the secret, never the secret), so that `mlxpipe serve --discover` finds it; needs the "
                             "cluster secret. Off unless given")
    add_security_arguments(parser, node=True)
    parser.add_argument("--insecure", action="store_true",
                        help="allow listening beyond loopback without a cluster secret (not recommended)")
    parser.add_argument("--models-dir", default=None,
                        help="the folder model paths from a head must lie in (default $MLXPIPE_HOME/models); "
                             "Hugging Face repo ids are looked up in the local HF cache")
    parser.add_argument("--memory", default=None,
                        help="memory this node offers for weights and caches, e.g. 150GB "
                             "(default: 75%% of physical memory)")
    parser.add_argument("--prefix-cache-disk", default=None, metavar="SIZE",
                        help="disk this node's prefix cache may fill under $MLXPIPE_HOME, e.g. 50GB; 0: none "
                             "(default: what the head asks, else 10%% of the free disk). Wins over the head's")
    parser.add_argument("--group-port", type=int, default=0, metavar="PORT",
                        help="where this node's rank of a tensor-parallel group listens for its peers (MLX's "
                             "ring backend: plain TCP, no secret, not encrypted; default: a free port)")
    parser.add_argument("--cpu", type=int, default=None,
                        help="pin this process to one CPU core (Linux), so that it stands for one node")
    add_launch_ahead(parser)
    parser.add_argument("--kv-bits", type=int, choices=KV_BITS, default=16,
                        help=KV_BITS_HELP + "; a head's own --kv-bits wins, and only a head's lets the pipeline match "
                             "mlx-lm's tokens and plan the memory saved (docs/planning.md)")
    parser.add_argument("--kv-group-size", type=int, choices=(32, 64, 128), default=DEFAULT_KV_GROUP_SIZE,
                        help=KV_GROUP_SIZE_HELP)
    parser.add_argument("--quantized-kv-start", type=int, default=DEFAULT_QUANTIZED_KV_START, metavar="N",
                        help=KV_START_HELP)
    parser.add_argument("--join", default=None, metavar="HEAD:PORT",
                        help="offer this node to a head (`mlxpipe serve --join-listen`), with the cluster secret")
    parser.add_argument("--advertise", default=None, metavar="HOST:PORT",
                        help="the address the head should reach this node at (default: the listen address, "
                             "or this machine's address toward the head)")
    parser.add_argument("--exit-with-parent", action="store_true",
                        help="stop when the parent process exits (for stages a head starts itself)")
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR (default %(default)s)")


def run(args) -> int:
    logging.basicConfig(stream=sys.stderr, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    logging.getLogger().setLevel(args.log_level)
    security = Security.from_args(args)
    if args.listen is None:
        args.listen = "0.0.0.0:50051" if args.announce else "127.0.0.1:50051"
    host = args.listen.rpartition(":")[0]
    if args.announce and (not security.secret or _loopback(host)):
        raise SystemExit("--announce needs the cluster secret (--secret-file or $MLXPIPE_SECRET) and a --listen "
                         "address other than loopback: heads find only their own cluster's nodes, by its secret")
    if not _loopback(host) and not security.secret and not args.insecure:
        raise SystemExit(f"refusing to listen on {args.listen} without a cluster secret: anyone who can reach "
                         f"the port could run and read computations. Give --secret-file or ${SECRET_ENV} "
                         f"(the same on every node and the head), or --insecure to accept the risk.")
    if args.cpu is not None:
        if hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, {args.cpu})
        else:
            logger.warning("--cpu is not supported on this platform")
    memory = parse_size(args.memory) if args.memory else None
    kv = KvQuant.of(args.kv_bits, args.kv_group_size, args.quantized_kv_start)  # ValueError: one line
    disk = args.prefix_cache_disk
    disk = None if disk is None else 0 if disk.strip() == "0" else parse_size(disk)
    try:
        asyncio.run(serve(args.listen, security, memory,
                          Path(args.models_dir).expanduser() if args.models_dir else None,
                          exit_with_parent=args.exit_with_parent, join=args.join, advertise=args.advertise,
                          launch_ahead=args.launch_ahead, announce=args.announce, name=args.name, kv=kv,
                          disk_bytes=disk, group_port=args.group_port))
    except KeyboardInterrupt:
        pass
    return 0


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="mlxpipe node", description="Run one pipeline stage worker.")
    add_arguments(parser)
    try:
        sys.exit(run(parser.parse_args(argv)))
    except ValueError as err:  # a bad option or credential file: one line, no traceback
        parser.exit(2, f"mlxpipe node: error: {err}\n")


if __name__ == "__main__":
    main()
