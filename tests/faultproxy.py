"""A fault-injecting TCP proxy, for tests: delay, jitter, loss-like stalls, partitions.

This kernel has no netem, so faults between stages are injected here instead.
Bytes keep their order; each chunk is held for ``delay`` +- ``jitter`` seconds,
and with probability ``stall_p`` a chunk is held ``stall`` seconds more (what
a lost segment costs TCP: a retransmission later). ``partition()`` stops
forwarding in both directions while keeping the connections open, so the
peers see silence rather than a reset.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from typing import Optional, Set


class FaultProxy:
    def __init__(self, listen_host: str, target_host: str, target_port: int):
        self.listen_host, self.target = listen_host, (target_host, target_port)
        self.delay = self.jitter = self.stall = self.stall_p = 0.0
        self.partitioned = False
        self.bytes = 0
        self._writers: Set[asyncio.StreamWriter] = set()
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._server: Optional[asyncio.AbstractServer] = None
        self._rng = random.Random(0)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        self._ready.wait(10)
        self.port = self._server.sockets[0].getsockname()[1]
        self.address = f"{listen_host}:{self.port}"

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)

        async def start():
            self._server = await asyncio.start_server(self._handle, self.listen_host, 0)
            self._ready.set()

        self._loop.run_until_complete(start())
        self._loop.run_forever()

    def set(self, delay: float = 0.0, jitter: float = 0.0, stall: float = 0.0, stall_p: float = 0.0) -> None:
        self.delay, self.jitter, self.stall, self.stall_p = delay, jitter, stall, stall_p

    def partition(self, on: bool = True) -> None:
        self.partitioned = on

    def close(self) -> None:
        async def stop():
            self._server.close()
            for w in list(self._writers):
                w.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self._loop.stop()

        asyncio.run_coroutine_threadsafe(stop(), self._loop)
        self._thread.join(5)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.target)
        except OSError:
            writer.close()
            return
        self._writers |= {writer, up_writer}
        await asyncio.gather(self._pump(reader, up_writer), self._pump(up_reader, writer),
                             return_exceptions=True)
        for w in (writer, up_writer):
            self._writers.discard(w)
            w.close()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        queue: asyncio.Queue = asyncio.Queue()

        async def deliver():
            while True:
                due, data = await queue.get()
                if data is None:
                    writer.close()
                    return
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                while self.partitioned:  # silence: hold everything, drop nothing
                    await asyncio.sleep(0.05)
                writer.write(data)
                await writer.drain()

        sender = asyncio.ensure_future(deliver())
        last_due = 0.0
        try:
            while data := await reader.read(65536):
                self.bytes += len(data)
                hold = self.delay + self._rng.uniform(-self.jitter, self.jitter)
                if self.stall_p and self._rng.random() < self.stall_p:
                    hold += self.stall
                last_due = max(last_due, time.monotonic() + max(hold, 0.0))  # keep bytes in order
                await queue.put((last_due, data))
        finally:
            await queue.put((0.0, None))
            await asyncio.gather(sender, return_exceptions=True)


if __name__ == "__main__":  # python tests/faultproxy.py LISTEN_HOST TARGET_HOST TARGET_PORT DELAY_S
    import sys

    proxy = FaultProxy(sys.argv[1], sys.argv[2], int(sys.argv[3]))
    proxy.set(delay=float(sys.argv[4]))
    print(proxy.port, flush=True)
    threading.Event().wait()
