"""One ``Forward`` call of a stage: frames in from the previous stage (or the head),
run on the MLX thread, outputs out to the next stage (or the head's ``Results``).

One hand-off each way per frame: the reader submits each frame to the MLX thread
as soon as it is read (in order, at most ``QUEUE_FRAMES`` of a stream in flight:
past that the reader stops reading and gRPC's flow control pushes back), and the
MLX thread hands the frame's output back to the event loop with one
``call_soon_threadsafe``: the last stage's result goes on the head's ``Results``
queue there and then, another stage's output to the sender, which writes it to
the next stage's ``Forward`` stream. A frame that fails stops the stream's later
frames from running (the MLX thread skips them) and ends the stream at once.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time

from mlxpipe.proto.errors import FrameError
from mlxpipe.proto.rpc import culprits_metadata, malformed

logger = logging.getLogger(__name__)

QUEUE_FRAMES = 64  # frames of one Forward stream in flight on a stage before gRPC flow control pushes back


class StageFault(RuntimeError):
    """A frame this stage accepted and then could not run (an error of the model's
    code, of MLX): the pipeline's fault, not the frame's. Names the frame's sequences,
    so that the head can tell a sequence that keeps breaking the pipeline."""

    def __init__(self, message: str, seq_ids):
        super().__init__(message)
        self.seq_ids = list(seq_ids)

    def metadata(self):
        return culprits_metadata(self.seq_ids)


class QueueDepth:
    """Frames read and not yet started on the MLX thread (Health's queue depth): each
    count is written by one thread only."""

    def __init__(self):
        self.arrived = 0  # event loop: frames read off the wire
        self.taken = 0    # MLX thread: frames started, or skipped after a failure or close

    def __int__(self) -> int:
        return max(self.arrived - self.taken, 0)


class _FrameJob:
    """One frame of a stream on the MLX thread (``MlxThread.frame``): launched, then
    finished; its output (or why it failed) goes back to the event loop in one
    ``call_soon_threadsafe``."""

    __slots__ = ("stream", "frame", "arrived", "launched")

    def __init__(self, stream: "ForwardStream", frame, arrived: float):
        self.stream, self.frame, self.arrived = stream, frame, arrived
        self.launched = None

    def launch(self):
        stream = self.stream
        stream.depth.taken += 1
        if stream.failed or stream.closed:  # an earlier frame failed, or the stream is gone: run no more
            return None
        try:
            self.launched = stream.shard.launch(self.frame, stream.session, self.arrived)
        except Exception as err:  # noqa: BLE001 - the frame's fault, or the stage's
            self._fail(err)
            return None
        return self

    def independent(self, job) -> bool:
        return self.launched.independent(job.frame)

    def finish(self, stolen: float) -> None:
        stream = self.stream
        if stream.failed or stream.closed:  # a frame launched after it failed first: its output is void
            self.launched.drop()
            return
        self.launched.stolen = stolen
        try:
            out = self.launched.finish()
        except Exception as err:  # noqa: BLE001
            self._fail(err)
            return
        stream.hand_back(out)

    def _fail(self, err: Exception) -> None:
        stream, frame = self.stream, self.frame
        stream.failed = True
        if not isinstance(err, FrameError):  # not the frame's own fault (refused, nothing changed): the stage's
            logger.exception("frame %d failed on this stage", frame.frame_id)
            if stream.loaded.spec is not None:  # a tensor group out of step for good (group.py)
                stream.loop.call_soon_threadsafe(stream.servicer.group_broken, f"frame {frame.frame_id} failed")
            req = stream.request
            fault = StageFault(f"stage with layers [{req.start}, {req.end}) failed running frame "
                               f"{frame.frame_id}: {type(err).__name__}: {err}", [e.seq_id for e in frame.seqs])
            fault.__cause__, err = err, fault
        stream.hand_back(err)


class ForwardStream:
    """One Forward call: a reader (frames off the wire, each submitted to the MLX thread
    at once), the MLX thread's outputs delivered back in order, a sender (to the next
    stage's Forward; the last stage's results go straight on the Results queue) and,
    into a next stage, a watcher: when that stage's stream ends, for any reason, this
    one ends at once with it, so a fault anywhere reaches the head at once."""

    def __init__(self, servicer, loaded, request_iterator, session: int):
        self.servicer, self.requests, self.session = servicer, request_iterator, session
        self.loaded, self.shard, self.request = loaded, loaded.shard, loaded.request
        self.mlx, self.depth, self.results = servicer.mlx, servicer.depth, servicer.results
        self.loop = asyncio.get_running_loop()
        self.last = not loaded.request.next_address
        self.room = asyncio.Semaphore(QUEUE_FRAMES)  # frames read and not yet delivered
        self.ready: collections.deque = collections.deque()  # outputs back from the MLX thread, not yet sent
        self.wake = asyncio.Event()  # for the sender: an output is ready, or reading ended
        self.outcome = self.loop.create_future()  # the stream's end: None, or the exception of a failed frame
        self.submitted = self.count = 0  # frames submitted to the MLX thread; outputs sent
        self.read_all = False
        self.sending = False  # the sender holds an output it is writing
        self.failed = False  # set on the MLX thread when a frame fails
        self.closed = False  # set on the event loop when the stream ends
        self.downstream = None
        if not self.last:
            self.downstream = servicer.next_stub.Forward(metadata=servicer.security.metadata())
        self.tasks = []

    async def run(self) -> None:
        steps = [self.read, self.send] + ([self.watch] if self.downstream is not None else [])
        self.tasks = [asyncio.ensure_future(step()) for step in steps]
        done, _ = await asyncio.wait([*self.tasks, self.outcome], return_when=asyncio.FIRST_EXCEPTION)
        for fut in done:
            if fut.exception() is not None:
                raise fut.exception()
        await asyncio.gather(*self.tasks)

    async def read(self) -> None:
        async for frame in self.requests:
            if (why := malformed(frame)) is not None:
                raise FrameError(why)
            self.servicer.in_link.arrived(len(frame.hidden.data) + 4 * len(frame.tokens), frame.sent_us)
            await self.room.acquire()
            self.depth.arrived += 1
            self.submitted += 1
            self.mlx.frame(_FrameJob(self, frame, time.perf_counter()))
        self.read_all = True
        self.wake.set()

    def hand_back(self, out) -> None:
        """From the MLX thread: a frame's output, or its failure."""
        try:
            self.loop.call_soon_threadsafe(self.deliver, out)
        except RuntimeError:  # the event loop is closed: the node is stopping
            pass

    def deliver(self, out) -> None:
        """A frame's output (or its failure) back from the MLX thread, in frame order (event loop)."""
        if self.closed:
            return
        if isinstance(out, BaseException):
            if not self.outcome.done():
                self.outcome.set_exception(out)
            return
        if self.last and not self.ready and not self.sending and not self.results.full():
            self.results.put_nowait(out)  # no task to wake on the way to the head
            self._sent()
            if self._all_sent():
                self.wake.set()
            return
        self.ready.append(out)
        self.wake.set()

    def _sent(self) -> None:
        self.count += 1
        self.room.release()

    def _all_sent(self) -> bool:
        return self.read_all and self.count == self.submitted

    async def send(self) -> None:
        while self.ready or not self._all_sent():
            if not self.ready:
                self.wake.clear()
                await self.wake.wait()
                continue
            out = self.ready.popleft()
            self.sending = True
            if self.last:
                await self.results.put(out)
            else:
                out.sent_us = time.time_ns() // 1000  # for the next stage's view of this hop (links.py)
                await self.downstream.write(out)
            self.sending = False
            self._sent()
        if self.downstream is not None:
            await self.downstream.done_writing()
        if not self.outcome.done():
            self.outcome.set_result(None)

    async def watch(self) -> None:
        await self.downstream  # its summary once it ends after our done_writing; raises if it fails first

    async def close(self) -> None:
        """However the stream ended: stop its tasks, its frames not yet run and the next
        stage's stream, and free its sequences (the head replays them) once every frame
        it submitted has finished or been skipped on the MLX thread."""
        self.closed = True
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        if not self.outcome.done():
            self.outcome.cancel()
        if self.downstream is not None and not self.downstream.done():
            self.downstream.cancel()
        freed = await asyncio.shield(self.loop.run_in_executor(self.mlx, self.shard.free_session, self.session))
        if freed:
            logger.info("stream %d ended; freed %d sequences", self.session, freed)
