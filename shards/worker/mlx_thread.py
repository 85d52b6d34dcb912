"""The one thread that owns MLX in a stage process.

Jobs run one at a time, in the order they were given: plain calls (``submit``: an
``Executor``'s, so ``loop.run_in_executor`` takes it: Load, Free, Profile, ...) and
frames (``frame``: a job with ``launch()``, which returns what to ``finish(stolen)``
later, or None). A launched frame is finished at once unless the next job is there
already and is a frame it is ``independent`` of: that one is launched first, so
that the thread builds its graph while MLX runs the earlier one (``stolen``: the
seconds that took). A plain call always finds every earlier frame finished.
Launching ahead is on where MLX computes on a GPU (the thread is free while it
runs); on MLX's CPU backend it is off by default: measured with ``mlxpipe bench
overhead`` on 2 shared cores, the stream thread and this one contend, and 8
streams lost a third of their tokens/s to it. Where it is on, a stage also
launches each block of its range as soon as it is built
(``SlicedModel.launch_blocks``), so that a lone stream's frame, which has no
frame behind it to overlap, is built while it runs. ``mlxpipe node
--launch-ahead/--no-launch-ahead`` (``serve`` passes its own to local stages)
decides either way.

At exit the thread is stopped and joined (as ``ThreadPoolExecutor``'s are): jobs
still queued are dropped, so that no MLX work runs while the interpreter ends.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
from concurrent.futures import Executor, Future
from typing import Optional

import mlx.core as mx

logger = logging.getLogger(__name__)


class _Call:
    __slots__ = ("future", "fn", "args", "kwargs")

    def __init__(self, future: Future, fn, args, kwargs):
        self.future, self.fn, self.args, self.kwargs = future, fn, args, kwargs

    def run(self) -> None:
        if not self.future.set_running_or_notify_cancel():
            return
        try:
            result = self.fn(*self.args, **self.kwargs)
        except BaseException as err:  # noqa: BLE001 - the caller's to handle
            self.future.set_exception(err)
        else:
            self.future.set_result(result)


class MlxThread(Executor):
    """A one-thread executor that also takes frames in two halves (module docstring)."""

    def __init__(self, name: str = "mlx", ahead: Optional[bool] = None):
        self.ahead = ahead if ahead is not None else mx.default_device().type == mx.DeviceType.gpu
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._stopped = False
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()
        atexit.register(self.shutdown)

    def submit(self, fn, /, *args, **kwargs) -> Future:
        if self._stopped:
            raise RuntimeError("the MLX thread has been shut down")
        future: Future = Future()
        self._jobs.put(_Call(future, fn, args, kwargs))
        return future

    def frame(self, job) -> None:
        """Queue a frame job (``launch()``, ``independent(job)``, ``finish(stolen)``)."""
        self._jobs.put(job)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Stop after the job in progress (jobs still queued are dropped, their futures cancelled)."""
        if not self._stopped:
            self._stopped = True
            self._jobs.put(None)
        if wait and self._thread is not threading.current_thread():
            self._thread.join()

    def _work(self) -> None:
        held = None  # a launched frame whose finish waits to see the next job
        while True:
            try:
                job = self._jobs.get() if held is None else self._jobs.get_nowait()
            except queue.Empty:
                held.finish(0.0)
                held = None
                continue
            if held is not None and job is not None and not isinstance(job, _Call) and not self._stopped \
                    and self.ahead and held.independent(job):
                t0 = time.perf_counter()
                launched = job.launch()
                held.finish(time.perf_counter() - t0)
                held = launched
                continue
            if held is not None:
                held.finish(0.0)
                held = None
            if job is None:
                return
            if self._stopped:  # dropped: nothing runs once the thread is told to stop
                if isinstance(job, _Call):
                    job.future.cancel()
                continue
            if isinstance(job, _Call):
                job.run()
            else:
                held = job.launch()
