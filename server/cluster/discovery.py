"""Finding this cluster's nodes on the local network: ``serve --discover``, ``nodes --discover``.

The head browses DNS-SD for ``_mlxpipe._tcp`` (python-zeroconf; nodes announce
themselves with ``mlxpipe node --announce``, ``shards/net/announce.py``). A node it
finds is *usable* only when all of these hold, else it is listed with the reason:

- it announces this cluster's id (an HMAC of a fixed label under the secret:
  another secret, another id);
- its address lies on a network one of this machine's interfaces is on
  (discovery never reaches past the link: nothing routed from afar);
- it answers ``Hello`` with proof that it holds the secret, for the very address
  the head dials (so the head never sends its secret to an impostor that copied
  the id from the air);
- it runs what the head runs, and its clock agrees (``checks.py``).

Then it is authenticated with the secret like any node. Every node found is
pinged every ``CHECK_EVERY_S``; one that has not answered for ``DROP_AFTER_S``
is dropped from the list (and from the next plan, ``rebuild.py``), one that says
goodbye at once; one that answers again is checked again and comes back.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Awaitable, Callable, Dict, List, Optional

import grpc

from mlxpipe.proto import pipeline_pb2 as pb
from mlxpipe.proto import pipeline_pb2_grpc as pb_grpc
from mlxpipe.proto.rpc import Security
from mlxpipe.server.cluster import checks
from mlxpipe.shards.net import hello
from mlxpipe.shards.net.announce import SERVICE

logger = logging.getLogger(__name__)

DROP_AFTER_S = 5.0   # a node silent this long leaves the list
CHECK_EVERY_S = 1.0  # how often every node found is pinged
SETTLE_S = 2.0       # at start, how long after the last node found the head waits for more


@dataclass
class Found:
    """A node that announced itself, and what the head made of it."""

    instance: str
    address: str
    name: str = ""
    memory_bytes: int = 0
    chip: str = ""
    versions: Dict[str, str] = field(default_factory=dict)
    cluster: str = ""        # "this", "another" or "unknown" (no secret here to tell)
    rdma: List[str] = field(default_factory=list)  # its RDMA devices (Thunderbolt 5: a tensor group's fast link)
    usable: bool = False
    why: str = "not checked yet"
    present: bool = True     # False: silent past DROP_AFTER_S (kept, to notice it come back)
    last_answer: float = field(default_factory=time.monotonic)

    def to_dict(self) -> dict:
        out = asdict(self)
        out["silent_s"] = round(time.monotonic() - out.pop("last_answer"), 1)
        return out


def on_link(host: str) -> bool:
    """Whether ``host`` lies on a network one of this machine's interfaces is on."""
    import ifaddr

    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    for adapter in ifaddr.get_adapters():
        for a in adapter.ips:
            if isinstance(a.ip, str) and ip in ipaddress.ip_network(f"{a.ip}/{a.network_prefix}", strict=False):
                return True
    return False


Callback = Callable[[Found], Awaitable[None]]


class Discovery:
    """Browses for nodes until ``stop``; ``on_usable``/``on_gone`` hear of nodes arriving and leaving."""

    def __init__(self, security: Security, on_usable: Optional[Callback] = None, on_gone: Optional[Callback] = None):
        self.security = security
        self.cluster = hello.cluster_id(security.secret)
        self.on_usable, self.on_gone = on_usable, on_gone
        self.found: Dict[str, Found] = {}  # instance -> what it is
        self.changed = asyncio.Event()     # set whenever a node becomes usable
        self._tasks: set = set()
        self._azc = self._browser = self._watcher = None

    async def start(self) -> "Discovery":
        from zeroconf import IPVersion
        from zeroconf.asyncio import AsyncServiceBrowser, AsyncZeroconf

        self._azc = AsyncZeroconf(ip_version=IPVersion.V4Only)
        self._browser = AsyncServiceBrowser(self._azc.zeroconf, [SERVICE], handlers=[self._event])
        self._watcher = asyncio.ensure_future(self._watch())
        return self

    async def stop(self) -> None:
        for task in [self._watcher, *self._tasks]:
            if task is not None:
                task.cancel()
        if self._browser is not None:
            await self._browser.async_cancel()
        if self._azc is not None:
            await self._azc.async_close()

    def usable(self) -> List[str]:
        return sorted(f.address for f in self.found.values() if f.usable and f.present)

    def gone(self) -> set:
        """Addresses of nodes that were found and are silent (or left)."""
        return {f.address for f in self.found.values() if not f.present}

    def table(self) -> List[dict]:
        return [f.to_dict() for f in sorted(self.found.values(), key=lambda f: f.address) if f.present]

    async def wait(self, count: int, settle: float = SETTLE_S) -> List[str]:
        """Until ``count`` nodes are usable, then until none more comes for ``settle`` seconds."""
        while len(self.usable()) < count:
            logger.warning("looking for this cluster's nodes on the local network (%d of %d found)",
                           len(self.usable()), count)
            self.changed.clear()
            try:
                await asyncio.wait_for(self.changed.wait(), 10.0)
            except asyncio.TimeoutError:
                pass
        while True:
            self.changed.clear()
            try:
                await asyncio.wait_for(self.changed.wait(), settle)
            except asyncio.TimeoutError:
                return self.usable()

    # -- zeroconf's events, and checking what they name ----------------------------------

    def _event(self, zeroconf, service_type: str, name: str, state_change) -> None:
        from zeroconf import ServiceStateChange

        if state_change is ServiceStateChange.Removed:
            self._spawn(self._left(name))
        else:
            self._spawn(self._resolve(name))

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _resolve(self, instance: str) -> None:
        from zeroconf import IPVersion
        from zeroconf.asyncio import AsyncServiceInfo

        info = AsyncServiceInfo(SERVICE, instance)
        if not await info.async_request(self._azc.zeroconf, 3000):
            return
        props = {k.decode(): (v or b"").decode() for k, v in (info.properties or {}).items()}
        hosts = info.parsed_addresses(IPVersion.V4Only)
        host = next((h for h in hosts if on_link(h)), hosts[0] if hosts else "")
        found = Found(instance, f"{host}:{info.port}", props.get("name", ""), int(props.get("mem", "0") or 0),
                      props.get("chip", ""), {k: props.get(p, "") for k, p in
                                              (("mlxpipe", "ver"), ("mlx", "mlx"), ("mlx_lm", "mlxlm"))})
        found.rdma = [d for d in props.get("rdma", "").split(",") if d]
        await self._check(found, props.get("cid", ""), on_link(host))

    async def _check(self, found: Found, cid: str, near: bool) -> None:
        was = self.found.get(found.instance)
        found.cluster = "unknown" if not self.cluster else "this" if cid == self.cluster else "another"
        if found.cluster == "another":
            found.why = "another cluster (it announces another cluster id: another secret)"
        elif found.cluster == "unknown":
            found.why = "no cluster secret here to tell its cluster by"
        elif not near:
            found.why = f"{found.address} is not on a network this machine is on"
        else:
            try:
                facts = await checks.ask(found.address, self.security)
                found.why = checks.refusal(facts, need_proof=True) or ""
                found.memory_bytes = facts.reply.memory_bytes or found.memory_bytes
            except ConnectionError as err:
                found.why = str(err)
        found.usable = not found.why
        self.found[found.instance] = found
        if found.usable and not (was and was.usable and was.present and was.address == found.address):
            logger.warning("found node %s (%s) on the local network: %.1f GB, %s", found.name, found.address,
                           found.memory_bytes / 1e9, found.chip)
            self.changed.set()
            if self.on_usable is not None:
                await self.on_usable(found)
        elif not found.usable and (was is None or was.why != found.why):
            logger.warning("node %s (%s) is not usable: %s", found.name or found.instance, found.address, found.why)

    async def _left(self, instance: str) -> None:
        found = self.found.pop(instance, None)
        if found is not None and found.usable and found.present:
            logger.warning("node %s (%s) left the local network", found.name, found.address)
            if self.on_gone is not None:
                await self.on_gone(found)

    async def _watch(self) -> None:
        """Ping every node found each ``CHECK_EVERY_S``; drop the silent, take back the returning."""
        channels: Dict[str, grpc.aio.Channel] = {}
        try:
            while True:
                await asyncio.sleep(CHECK_EVERY_S)
                await asyncio.gather(*(self._ping(f, channels) for f in list(self.found.values())))
        finally:
            for ch in channels.values():
                await ch.close()

    async def _ping(self, found: Found, channels: Dict[str, grpc.aio.Channel]) -> None:
        if found.address not in channels:
            channels[found.address] = self.security.channel(found.address)
        try:
            await pb_grpc.StageStub(channels[found.address]).Ping(pb.PingRequest(), timeout=CHECK_EVERY_S)
        except grpc.aio.AioRpcError:
            if found.present and time.monotonic() - found.last_answer > DROP_AFTER_S:
                found.present = False
                logger.warning("node %s (%s) has not answered for %.0f s: dropped", found.name, found.address,
                               DROP_AFTER_S)
                if found.usable and self.on_gone is not None:
                    await self.on_gone(found)
            return
        found.last_answer = time.monotonic()
        if not found.present:  # back: check it again, as if new
            found.present = True
            found.usable = False
            await self._check(found, self.cluster if found.cluster == "this" else "", on_link(found.address
                                                                                             .rpartition(":")[0]))
