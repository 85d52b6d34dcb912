"""After a fault: which stages still answer, waiting for those that may come back.

The head's rule (the engine calls ``Cluster.rebuild``): the suspects a fault
names are a hint, what answers a health check now is the truth. Local stage
processes that died or stalled are restarted in place; remote nodes get
``rejoin_timeout_s`` to come back; whatever still does not answer is left out
and the layers are re-planned over the rest. A stage that cannot reach its
successor blames it, and the rebuild leaves the successor out. A tensor-parallel group
(``groups.py``) is one unit: local ranks are restarted together when any of them fails (a
group's collective forms once per process), remote ones restart themselves and are waited for,
and a group any of whose ranks is still down is left out whole.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable, Dict, List, Optional, Sequence

from mlxpipe.proto.rpc import Security
from mlxpipe.server.cluster.groups import Layout
from mlxpipe.server.cluster.local import LocalStages
from mlxpipe.server.cluster.stage_client import probe
from mlxpipe.server.core.transport import PipelineError

logger = logging.getLogger(__name__)


async def await_up(down: Dict[str, str], security: Security, timeout_s: float,
                   refuse: bool = False, gone: Callable[[], set] = set) -> Dict[str, str]:
    """Probe the stages in ``down`` (address -> why) about once a second until they
    answer or ``timeout_s`` passes; returns those still down. With ``refuse``, a
    stage that refuses this head's secret raises at once: waiting will not help.
    ``gone()``: addresses known to have left (discovery dropped them): not waited for."""
    deadline = time.monotonic() + timeout_s
    while True:
        if set(down) <= gone():
            return down
        refused = {a: e for a, e in down.items() if e.startswith("UNAUTHENTICATED")}
        if refuse and refused:
            raise PipelineError(f"nodes refused this head: {refused} (the cluster secret differs?)")
        if not down or time.monotonic() > deadline:
            return down
        await asyncio.sleep(1.0)
        down = {a: e for a, e in zip(down, await probe(list(down), security)) if e is not None}


async def await_nodes(addresses: List[str], security: Security, timeout_s: float) -> None:
    """Wait (up to ``timeout_s``) for every --nodes worker to answer."""
    errors = zip(addresses, await probe(addresses, security))
    down = await await_up({a: e for a, e in errors if e is not None}, security, timeout_s, refuse=True)
    if down:
        raise PipelineError(f"nodes did not answer within {timeout_s:.0f}s: {down}")


async def answering(layout: Layout, security: Security, local: Optional[LocalStages], restart: bool,
                    timeout_s: float, why: str, suspects: Sequence[str], gone: Callable[[], set] = set) -> List[str]:
    """The stages to rebuild over (their leaders), in pipeline order: local ones restarted where a
    rank died or stalled (with ``restart``; a group's every rank), remote ones whose every rank
    answers within ``timeout_s``."""
    every = layout.every()
    errors = dict(zip(every, await probe(every, security)))
    up = {a: err is None for a, err in errors.items()}
    logger.warning("rebuilding after: %s; suspects %s; answering: %s", why, list(suspects),
                   [a for a, ok in up.items() if ok])
    if local is not None and restart:
        for leader in layout.leaders:
            ranks = layout.ranks(leader)
            if all(up[a] and local.alive(local.addresses.index(a)) for a in ranks) and not (
                    len(ranks) > 1 and set(ranks) & set(suspects)):
                continue
            for a in ranks:  # a group's ranks all start afresh: its collective is made once per process
                await asyncio.to_thread(local.restart, local.addresses.index(a))
                up[a] = True
    elif local is None:
        still = await await_up({a: e for a, e in errors.items() if e is not None}, security, timeout_s, gone=gone)
        up = {a: a not in still for a in every}
    return [a for a in layout.leaders if all(up[r] for r in layout.ranks(a))]


async def build_leaving_out(alive: List[str], build: Callable[[List[str]], Awaitable], why: str,
                            layout: Optional[Layout] = None, wait: Optional[Callable[[List[str]], Awaitable]] = None):
    """``build(alive)``, again without the stages a failed build blames (a group's rank: its
    stage), until one loads. Nodes that restart to leave a tensor group (a plan that groups them
    anew) are waited for (``wait``) and tried once more first."""
    layout = layout or Layout([])
    waited = False
    while alive:
        try:
            return await build(alive)
        except PipelineError as err:  # e.g. a stage that cannot reach its successor
            if wait is not None and not waited and "this node restarts" in str(err):
                waited = True
                await wait(list(err.suspects))
                continue
            gone = {a for a in alive if set(layout.ranks(a)) & set(err.suspects)}
            if not gone:
                raise
            logger.warning("leaving out %s: %s", sorted(gone), err)
            alive = [a for a in alive if a not in gone]
    raise PipelineError(f"no stage is left to run the model ({why})")
