"""Finding this cluster's nodes on the local network: ``serve --discover``, ``nodes --discover``.

The head browses DNS-SD for ``_mlxpipe._tcp`` (python-zeroconf; nodes announce
themselves with ``mlxpipe node --announce``, ``shards/net/announce.py``). Anyone on the
link can announce anything, so an announcement is read field by field first
(``announce.read``: a field that fails its check is skipped, with one warning line,
escaped), and the head dials the address it names only when all of these hold
(``admission.py``):

- it announces this cluster's id (an HMAC of a fixed label under the secret:
  another secret, another id);
- the address lies on a network one of this machine's interfaces is on (a loopback
  address on loopback's): discovery never reaches past the link;
- it is none of this head's own listening sockets (its HTTP port, ``--join-listen``).

Anything else is listed as seen (``table``: ``/nodes``, ``mlxpipe nodes --discover``;
one log line) and never contacted. On a connection it dials, the head's first call is
``Hello`` (``shards/net/hello.py``): it sends a random nonce and the address it dialled,
nothing derived from the secret, and the node must answer with proof that it holds the
secret for that very address. One that answers without proof is not dialled again
while its announcement stays the same; one that does not answer, or runs other versions
or another clock (``checks.py``), is asked again after ``RECHECK_S``. A node that proved
it is usable, and from then on authenticated with the secret like any node.

Usable nodes are asked ``Hello`` again every ``CHECK_EVERY_S``, each answer proving the
secret anew (whoever takes over a node's address does not keep its place); one that has
not answered for ``DROP_AFTER_S`` is dropped from the list (and from the next plan,
``rebuild.py``), one that says goodbye at once; one that answers again is checked again
and comes back. While ``serve`` waits for nodes it says, after ``HINT_AFTER_S``, what it
has seen and what to check, and again only when that changes.
"""

from __future__ import annotations

import asyncio
import logging
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Awaitable, Callable, Dict, List, Optional, Sequence, Tuple

import grpc

from mlxpipe.proto.rpc import Security
from mlxpipe.server.cluster import checks
from mlxpipe.server.cluster.admission import choose, hint
from mlxpipe.shards.net import hello
from mlxpipe.shards.net.announce import SERVICE, Fields, read
from mlxpipe.shards.net.hello import shown

logger = logging.getLogger(__name__)

DROP_AFTER_S = 5.0    # a node silent this long leaves the list
CHECK_EVERY_S = 1.0   # how often every usable node is asked Hello
SETTLE_S = 2.0        # at start, how long after the last node found the head waits for more
RECHECK_S = 30.0      # a node that did not answer, or was refused for its versions or clock, is asked again after this
HINT_AFTER_S = 10.0   # while waiting for nodes: when the head says what it has seen and what to check
MAX_SEEN = 256        # announcements kept at once (more are ignored, with one line)
NEVER = float("inf")


@dataclass
class Found:
    """A node that announced itself, and what the head made of it."""

    instance: str            # its DNS-SD name, escaped (as every text here, safe to show)
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
    # How the head treats it: "list" (never dialled), "check" (dialled at check_at),
    # "checking" (a check under way), "watch" (proved the secret: asked each CHECK_EVERY_S).
    dial: str = "list"
    check_at: float = NEVER
    reason: str = ""         # what kind of refusal ``why`` is (admission.hint groups them)
    key: str = ""            # the instance as announced (the table's key)
    heard: tuple = ()        # what its announcement said: a change is judged afresh

    _PRIVATE = ("dial", "check_at", "reason", "key", "heard")

    def to_dict(self) -> dict:
        out = asdict(self)
        for k in self._PRIVATE:
            out.pop(k)
        out["silent_s"] = round(time.monotonic() - out.pop("last_answer"), 1)
        return out


Callback = Callable[[Found], Awaitable[None]]


class Discovery:
    """Browses for nodes until ``stop``; ``on_usable``/``on_gone`` hear of nodes arriving and leaving.
    ``listening``: this head's own listening sockets (host, port), never dialled."""

    def __init__(self, security: Security, on_usable: Optional[Callback] = None, on_gone: Optional[Callback] = None,
                 listening: Sequence[Tuple[str, int]] = (), check_every: float = CHECK_EVERY_S,
                 hint_after: float = HINT_AFTER_S):
        self.security = security
        self.cluster = hello.cluster_id(security.secret)
        self.on_usable, self.on_gone = on_usable, on_gone
        self.listening = list(listening)
        self.check_every, self.hint_after = check_every, hint_after
        self.found: Dict[str, Found] = {}  # announced instance -> what it is
        self.changed = asyncio.Event()     # set whenever a node becomes usable
        self._tasks: set = set()           # checks (and callbacks) under way
        self._told: Dict[str, str] = {}    # instance -> the last line logged of it
        self._said: set = set()            # lines logged once (skipped fields, too many nodes)
        self._channels: Dict[str, grpc.aio.Channel] = {}  # to usable nodes, for the Hello of each interval
        self._azc = self._browser = self._watcher = None

    async def start(self, browse: bool = True) -> "Discovery":
        """Browse DNS-SD (``browse``: tests hand announcements to ``take`` instead) and watch."""
        if browse:
            from zeroconf import IPVersion
            from zeroconf.asyncio import AsyncServiceBrowser, AsyncZeroconf

            self._azc = AsyncZeroconf(ip_version=IPVersion.V4Only)
            self._browser = AsyncServiceBrowser(self._azc.zeroconf, [SERVICE], handlers=[self._event])
        self._watcher = asyncio.ensure_future(self._watch())
        self._watcher.add_done_callback(self._failed)
        return self

    async def stop(self) -> None:
        tasks = [t for t in (self._watcher, *self._tasks) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._browser is not None:
            await self._browser.async_cancel()
        if self._azc is not None:
            await self._azc.async_close()
        for ch in self._channels.values():
            await ch.close()
        self._channels.clear()

    def usable(self) -> List[str]:
        return sorted(f.address for f in self.found.values() if f.usable and f.present)

    def gone(self) -> set:
        """Addresses of nodes that were found and are silent (or left)."""
        return {f.address for f in self.found.values() if not f.present}

    def table(self) -> List[dict]:
        return [f.to_dict() for f in sorted(self.found.values(), key=lambda f: f.address) if f.present]

    def checking(self) -> bool:
        """Whether checks of nodes found are under way."""
        return bool(self._tasks)

    async def wait(self, count: int, settle: float = SETTLE_S) -> List[str]:
        """Until ``count`` nodes are usable, then until none more comes for ``settle`` seconds.
        After ``hint_after`` without them: what was seen and what to check, logged when it changes."""
        if count > 0:
            logger.warning("looking for %d of this cluster's nodes on the local network (nodes started with "
                           "`mlxpipe node --announce` and this secret)", count)
        began, said = time.monotonic(), ""
        while len(self.usable()) < count:
            if time.monotonic() - began >= self.hint_after:
                line = hint(count, len(self.usable()), list(self.found.values()))
                if line != said:
                    logger.warning("%s", line)
                    said = line
            self.changed.clear()
            try:
                await asyncio.wait_for(self.changed.wait(), min(self.check_every, self.hint_after))
            except asyncio.TimeoutError:
                pass
        while True:
            self.changed.clear()
            try:
                await asyncio.wait_for(self.changed.wait(), settle)
            except asyncio.TimeoutError:
                return self.usable()

    # -- announcements heard, and checking what they name ---------------------------------

    def _event(self, zeroconf, service_type: str, name: str, state_change) -> None:
        from zeroconf import ServiceStateChange

        if state_change is ServiceStateChange.Removed:
            self._left(name)
        else:
            self._spawn(self._resolve(name))

    def _spawn(self, coro) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(self._failed)

    @staticmethod
    def _failed(task: asyncio.Future) -> None:
        """Log what ended a task (none dies unretrieved); its text escaped, as it may quote an announcement."""
        if task.cancelled() or task.exception() is None:
            return
        err = task.exception()
        logger.error("discovery: %s", shown(f"{type(err).__name__}: {err}", 300))
        logger.debug("discovery: where it failed:\n%s", "".join(traceback.format_tb(err.__traceback__)))

    def _once(self, line: str) -> None:
        if line in self._said or len(self._said) > 16 * MAX_SEEN:  # (bounded: a flood of them says no more)
            return
        self._said.add(line)
        logger.warning("%s", line)

    def _tell(self, found: Found, line: str) -> None:
        """Log ``line`` of ``found``, unless it is what was last said of it."""
        if self._told.get(found.key) != line:
            self._told[found.key] = line
            logger.warning("%s", line)

    async def _resolve(self, instance: str) -> None:
        from zeroconf import BadTypeInNameException, IPVersion
        from zeroconf.asyncio import AsyncServiceInfo

        try:
            info = AsyncServiceInfo(SERVICE, instance)
        except BadTypeInNameException as err:  # (zeroconf's own check: control characters in the name)
            return self._once(f"announcement {shown(instance, 80)} ignored: {shown(str(err), 200)}")
        if not await info.async_request(self._azc.zeroconf, 3000):
            return
        fields, skipped = read(info.properties or {})
        await self.take(instance, info.parsed_addresses(IPVersion.V4Only), info.port or 0, fields, skipped)

    async def take(self, instance: str, hosts: Sequence[str], port: int, fields: Fields,
                   skipped: Sequence[str] = ()) -> None:
        """An announcement heard (``fields`` read by ``announce.read``, which also said what it
        ``skipped``): listed, and dialled only where it may be (``admission.choose``)."""
        label = shown(instance.removesuffix("." + SERVICE), 80)
        was = self.found.get(instance)
        if was is None and len(self.found) >= MAX_SEEN:
            return self._once(f"more than {MAX_SEEN} nodes announce themselves here: the others are ignored")
        for line in skipped:
            self._once(f"announcement {label}: {line}")
        host, reason, why = choose(hosts, port, fields.cluster_id, self.cluster, self.listening)
        found = Found(label, f"{host or '?'}:{port}", fields.name, fields.memory_bytes, fields.chip,
                      dict(fields.versions), rdma=list(fields.rdma), key=instance,
                      heard=(tuple(hosts), port, repr(fields)),
                      cluster="unknown" if not self.cluster else "this" if fields.cluster_id == self.cluster
                      else "another")
        if was is not None and was.heard == found.heard:
            return  # nothing new: judged already (and a failed check is asked again in time)
        self.found[instance] = found
        if was is not None and was.usable and was.present:
            self._notify(self.on_gone, was)  # it now announces something else: judged afresh
        if reason:
            found.reason, found.why = reason, why
            self._tell(found, f"node {found.name or label} ({found.address}) is not used: {why}")
            return
        await self._check(found)

    async def _check(self, found: Found) -> None:
        """Hello, the first call on a fresh connection: usable only with proof of the secret."""
        found.dial, found.check_at, found.usable = "checking", NEVER, False
        try:
            facts = await checks.ask(found.address, self.security)
        except ConnectionError as err:
            return self._refused(found, "silent", str(err), again=True)
        if self.found.get(found.key) is not found:
            return  # it left, or announced something else, meanwhile
        if not facts.proved:
            return self._refused(found, "stranger", f"it answers without proof of this cluster's secret for "
                                                    f"{found.address}", again=False)
        why = checks.refusal(facts, need_proof=True)
        if why:
            return self._refused(found, "refused", why, again=True)
        found.memory_bytes = facts.reply.memory_bytes or found.memory_bytes
        found.usable, found.why, found.reason, found.dial = True, "", "", "watch"
        found.present, found.last_answer = True, time.monotonic()
        self._tell(found, f"found node {found.name or found.instance} ({found.address}) on the local network: "
                          f"{found.memory_bytes / 1e9:.1f} GB, {found.chip}")
        self.changed.set()
        self._notify(self.on_usable, found)

    def _refused(self, found: Found, reason: str, why: str, again: bool) -> None:
        found.usable, found.reason, found.why = False, reason, why
        found.dial, found.check_at = ("check", time.monotonic() + RECHECK_S) if again else ("list", NEVER)
        if self.found.get(found.key) is found:
            self._tell(found, f"node {found.name or found.instance} ({found.address}) is not usable: {why}")

    def _notify(self, callback: Optional[Callback], found: Found) -> None:
        """Tell ``callback`` of ``found`` in a task of its own (a re-plan takes minutes; checks go on)."""
        if callback is not None:
            self._spawn(callback(found))

    def _left(self, instance: str) -> None:
        found = self.found.pop(instance, None)
        self._told.pop(instance, None)
        if found is not None and found.usable and found.present:
            logger.warning("node %s (%s) left the local network", found.name or found.instance, found.address)
            self._notify(self.on_gone, found)

    # -- every interval: usable nodes asked again, failed checks retried -------------------

    async def _watch(self) -> None:
        try:
            while True:
                await asyncio.sleep(self.check_every)
                now = time.monotonic()
                for f in list(self.found.values()):
                    if f.dial == "check" and f.check_at <= now:
                        f.dial = "checking"
                        self._spawn(self._check(f))
                watched = [f for f in self.found.values() if f.dial == "watch"]
                await asyncio.gather(*(self._ping(f) for f in watched))
                for address in set(self._channels) - {f.address for f in watched}:
                    await self._channels.pop(address).close()
        finally:
            for ch in self._channels.values():
                await ch.close()
            self._channels.clear()

    async def _ping(self, found: Found) -> None:
        """Hello again, on a kept channel: it must prove the secret each time."""
        if found.address not in self._channels:
            self._channels[found.address] = self.security.channel(found.address)
        try:
            facts = await checks.ask(found.address, self.security, timeout=self.check_every,
                                     channel=self._channels[found.address])
        except ConnectionError:
            if found.present and time.monotonic() - found.last_answer > DROP_AFTER_S:
                found.present = False
                self._tell(found, f"node {found.name or found.instance} ({found.address}) has not answered for "
                                  f"{DROP_AFTER_S:.0f} s: dropped")
                if found.usable:
                    self._notify(self.on_gone, found)
            return
        if self.found.get(found.key) is not found or found.dial != "watch":
            return
        if not facts.proved:
            listed = found.usable and found.present
            self._refused(found, "stranger", f"{found.address} no longer proves it holds this cluster's secret",
                          again=False)
            if listed:
                self._notify(self.on_gone, found)
            return
        found.last_answer = time.monotonic()
        if not found.present:  # back: check it again, as if new
            found.present, found.dial = True, "checking"
            self._spawn(self._check(found))
