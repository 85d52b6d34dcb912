"""Keeping a pipeline up: the supervisor of an ``Engine``.

It runs the engine's pipeline and watches three things: the Results stream, the
Forward stream and, every ``health_interval_s``, every stage's health. When one
fails (or the cluster changed and the layers are re-planned) it stops the
engine's sending, hands the fault to ``rebuild`` (which restarts, waits for or
leaves out the failed stages, re-plans and reloads), has the scheduler replay
every live sequence from its prompt plus the tokens generated so far, and goes
on. Clients see a pause. Only when no pipeline can be rebuilt does the engine
fail its live requests (``Engine.fail``), and the supervisor keeps trying.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Awaitable, Callable, List, Optional, Sequence, Tuple

from mlxpipe.server.core.transport import PipelineError, Transport

logger = logging.getLogger(__name__)


@dataclass
class Supervision:
    """How a pipeline is watched and recovered."""

    health_interval_s: float = 1.0   # how often every stage's health is checked
    health_timeout_s: float = 2.0    # a stage that does not answer within this is down
    recovery_timeout_s: float = 120.0  # one rebuild (restart or wait, re-plan, reload) at most
    retry_interval_s: float = 5.0    # after a failed recovery, try again this often


class Replan(RuntimeError):
    """Not a fault: the cluster changed (a node joined) and the layers are re-planned."""


class StageDown(RuntimeError):
    """A health check found a stage dead, stalled or not ready."""

    def __init__(self, message: str, suspects: Sequence[str]):
        super().__init__(message)
        self.suspects = list(suspects)


@dataclass
class Rebuilt:
    """What a rebuild changed: the new pipeline, and the KV positions its stages hold."""

    pipeline: Transport
    max_kv_tokens: int
    prefix_blocks: int  # blocks each stage may keep for the prefix cache
    disk_blocks: int = 0  # ... and on its disk (0: some stage has no disk tier)


# rebuild(why, addresses of suspect stages) -> a loaded pipeline without the fault, or raises.
Rebuild = Callable[[str, Sequence[str]], Awaitable[Rebuilt]]


class Supervisor:
    """Runs ``engine``'s pipeline until it breaks, then rebuilds it (``run``). ``engine`` is the
    ``engine.Engine`` it supervises (not imported: the engine imports this module)."""

    def __init__(self, engine, rebuild: Optional[Rebuild], settings: Supervision):
        self.engine = engine
        self.rebuild = rebuild
        self.settings = settings
        self._replan = asyncio.Event()
        self._replan_why = ""
        self._rebuilt = asyncio.Event()  # set after each rebuild

    async def request_replan(self, why: str, timeout: float = 300.0) -> None:
        """Rebuild the pipeline over the cluster's current nodes (live sequences pause and
        replay); returns when the new pipeline runs."""
        self._rebuilt.clear()
        self._replan_why = why
        self._replan.set()
        await asyncio.wait_for(self._rebuilt.wait(), timeout)

    async def _monitor(self) -> None:
        sup = self.settings
        while True:
            await asyncio.sleep(sup.health_interval_s)
            down = []
            for i, (st, reply, err) in enumerate(await self.engine.pipeline.health(timeout=sup.health_timeout_s)):
                if reply is None or reply.state != "ready":
                    down.append((st.address, f"stage {i} at {st.address} is "
                                    + (f"unreachable ({err})" if reply is None else f"{reply.state}: {reply.detail}")))
            if down:
                raise StageDown("; ".join(d for _, d in down), [a for a, _ in down])

    async def _await_replan(self) -> None:
        await self._replan.wait()
        self._replan.clear()
        raise Replan(self._replan_why)

    async def _run_pipeline(self) -> Tuple[str, List[str], bool, List[int]]:
        """Run until the pipeline breaks or a re-plan is asked for; return why,
        which stages are suspect, whether it was a fault, and the sequences whose
        frame a stage failed on (when it said)."""
        tasks = [asyncio.ensure_future(c) for c in (self.engine.read_results(), self._monitor(),
                                                    self.engine.pipeline.watch_forward(), self._await_replan())]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        err = next(iter(done)).exception()
        if isinstance(err, Replan):
            return f"re-plan: {err}", [], False, []
        if isinstance(err, (StageDown, PipelineError)):
            return str(err), list(err.suspects), True, list(getattr(err, "culprits", []))
        if err is None:
            return "the pipeline's streams closed", [], True, []
        logger.error("engine failure", exc_info=err)
        return f"{type(err).__name__}: {err}", [], True, []

    async def run(self) -> None:
        engine = self.engine
        while True:
            why, suspects, fault, culprits = await self._run_pipeline()
            if engine.stopping:
                return
            logger.warning("%s: %s", "pipeline broke" if fault else "rebuilding", why)
            engine.fail_culprits(culprits, why)
            if self.rebuild is None:
                engine.fail(why)
                return
            engine.state, engine.failure = "recovering", why
            live = await engine.pause()
            logger.warning("recovering; %d live sequences will be replayed", len(live))
            await self._rebuild(why, suspects)
            engine.state, engine.failure = "ready", None
            engine.stats.recoveries += fault
            logger.warning("running again: %d stages", len(engine.pipeline.stages))
            self._rebuilt.set()
            engine.resume()

    async def _rebuild(self, why: str, suspects: Sequence[str]) -> None:
        """Until a pipeline is rebuilt and opened (live requests fail meanwhile once a try fails)."""
        while True:
            try:
                rebuilt = await asyncio.wait_for(self.rebuild(why, suspects), self.settings.recovery_timeout_s)
                await self.engine.swap_pipeline(rebuilt)
                return
            except Exception as err:  # noqa: BLE001 - any failure to rebuild ends the live requests
                reason = f"{why}; no pipeline could be rebuilt: {err}"
                if self.engine.state != "failed":
                    self.engine.fail(reason)
                await asyncio.sleep(self.settings.retry_interval_s)
