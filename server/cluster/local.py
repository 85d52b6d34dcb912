"""Stage worker processes on this machine, one per stage, on loopback."""

from __future__ import annotations

import logging
import os
import selectors
import subprocess
import sys
from pathlib import Path
from typing import List, Optional

from mlxpipe.proto.rpc import SECRET_ENV
from mlxpipe.server.core.transport import PipelineError

logger = logging.getLogger(__name__)


def available_cpus() -> List[int]:
    """The cores this process may run on; stage i is pinned to the i-th (round robin)."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def placement(count: int, pin: Optional[bool]) -> Optional[List[int]]:
    """The cores ``count`` local stages are pinned to, round robin (None: the OS
    places them). ``pin`` None: pinned where there is a core for each and the
    platform can pin (Linux)."""
    cpus = available_cpus()
    if pin is None:
        pin = hasattr(os, "sched_setaffinity") and count <= len(cpus)
    return cpus if pin else None


class LocalStages:
    """Stage worker processes on this machine, one per stage, on loopback."""

    def __init__(self, count: int, secret: str, models_dir: Path, host: str = "127.0.0.1",
                 cpus: Optional[List[int]] = None, log_level: str = "WARNING",
                 launch_ahead: Optional[bool] = None):
        self.count, self.host, self.cpus, self.log_level = count, host, cpus, log_level
        self.launch_ahead = launch_ahead
        self.secret, self.models_dir = secret, models_dir
        self.procs: List[subprocess.Popen] = []
        self.addresses: List[str] = []

    def start(self, timeout: float = 120.0) -> List[str]:
        try:
            for i in range(self.count):
                self.procs.append(self.spawn(i))
            for proc in self.procs:
                self.addresses.append(self._await_ready(proc, timeout))
        except BaseException:
            self.stop()
            raise
        return self.addresses

    def spawn(self, i: int, listen: Optional[str] = None) -> subprocess.Popen:
        """Start stage process ``i`` (on a free port unless ``listen`` is given)."""
        cmd = [sys.executable, "-m", "mlxpipe.shards.worker.node", "--listen", listen or f"{self.host}:0",
               "--log-level", self.log_level, "--exit-with-parent", "--models-dir", str(self.models_dir)]
        if self.cpus:
            cmd += ["--cpu", str(self.cpus[i % len(self.cpus)])]
        if self.launch_ahead is not None:
            cmd.append("--launch-ahead" if self.launch_ahead else "--no-launch-ahead")
        # The secret goes by environment, not argv, which other users can read.
        # A session of its own: a Ctrl-C in the head's terminal reaches the head
        # alone, which then stops its stages in order (``stop``).
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, start_new_session=True,
                                env=os.environ | {SECRET_ENV: self.secret})

    @staticmethod
    def _await_ready(proc: subprocess.Popen, timeout: float) -> str:
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            proc.kill()
            raise PipelineError(f"stage process {proc.pid} did not start within {timeout:.0f}s")
        line = proc.stdout.readline().strip()
        if not line.startswith("mlxpipe node listening on "):
            proc.kill()
            raise PipelineError(f"stage process {proc.pid} failed to start (exit {proc.poll()}): {line!r}")
        return line.rsplit(" ", 1)[1]

    def alive(self, i: int) -> bool:
        return self.procs[i].poll() is None

    def restart(self, i: int, timeout: float = 120.0) -> str:
        """Kill stage process ``i`` (dead, stalled or not) and start it again on its address."""
        old = self.procs[i]
        if old.poll() is None:
            old.kill()  # works on a stopped (SIGSTOP) process too
        old.wait()
        self.procs[i] = self.spawn(i, listen=self.addresses[i])
        address = self._await_ready(self.procs[i], timeout)
        logger.warning("restarted stage process %d on %s", i, address)
        return address

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
