"""The head's side of the wire: stage processes, shard loading, frames in, results out.

``LocalStages`` starts stage worker processes on this machine. ``Pipeline``
connects to a list of stage addresses (local or remote), tells each which
layers of which model to load and where its next stage is, then keeps two
long-lived streams open: ``Forward`` into stage 0 and ``Results`` out of the
last stage. Activations never pass through here.
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator, List, Optional, Sequence, Tuple

import grpc

from mlxpipe.proto import pipeline_pb2 as pb
from mlxpipe.proto import pipeline_pb2_grpc as pb_grpc
from mlxpipe.proto.rpc import SECRET_ENV, Security, culprits_of
from mlxpipe.server.core.transport import PipelineError
from mlxpipe.shards.quant_spec import QuantSpec, quantized_fingerprint
from mlxpipe.shards.quantize import QuantizeError, prepare, stage_units, write_config, write_units
from mlxpipe.shards.store import mlxpipe_home
from mlxpipe.shards.weights import Unit, model_units, units_for_range

logger = logging.getLogger(__name__)

LOAD_TIMEOUT_S = 900.0
CALL_TIMEOUT_S = 10.0


def even_split(num_layers: int, stages: int) -> List[Tuple[int, int]]:
    """Half-open layer ranges of (nearly) equal size; earlier stages get the extra
    layers, since the last one also carries the output head."""
    if not 1 <= stages <= num_layers:
        raise ValueError(f"cannot cut {num_layers} layers into {stages} stages")
    base, extra = divmod(num_layers, stages)
    ranges, start = [], 0
    for i in range(stages):
        end = start + base + (1 if i < extra else 0)
        ranges.append((start, end))
        start = end
    return ranges


def split_from_sizes(sizes: Sequence[int], num_layers: int) -> List[Tuple[int, int]]:
    """``--split 18,12`` -> [(0, 18), (18, 30)]."""
    if any(s <= 0 for s in sizes) or sum(sizes) != num_layers:
        raise ValueError(f"split {list(sizes)} must be positive and sum to the model's {num_layers} layers")
    ranges, start = [], 0
    for s in sizes:
        ranges.append((start, start + s))
        start += s
    return ranges


class LocalStages:
    """Stage worker processes on this machine, one per stage, on loopback."""

    def __init__(self, count: int, secret: str, models_dir: Path, host: str = "127.0.0.1",
                 cpus: Optional[List[int]] = None, log_level: str = "WARNING"):
        self.count, self.host, self.cpus, self.log_level = count, host, cpus, log_level
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
        cmd = [sys.executable, "-m", "mlxpipe.shards.node", "--listen", listen or f"{self.host}:0",
               "--log-level", self.log_level, "--exit-with-parent", "--models-dir", str(self.models_dir)]
        if self.cpus:
            cmd += ["--cpu", str(self.cpus[i % len(self.cpus)])]
        # The secret goes by environment, not argv, which other users can read.
        # A session of its own: a Ctrl-C in the head's terminal reaches the head
        # alone, which then stops its stages in order (``stop``).
        return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, start_new_session=True,
                                env=os.environ | {SECRET_ENV: self.secret})

    @staticmethod
    def _await_ready(proc: subprocess.Popen, timeout: float) -> str:
        import selectors

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


async def probe(addresses: Sequence[str], security: Security, timeout: float = 2.0) -> List[Optional[str]]:
    """For each stage: None when it answers a health check within ``timeout``, else why not."""

    async def one(address: str) -> Optional[str]:
        async with security.channel(address) as channel:
            try:
                await pb_grpc.StageStub(channel).Health(pb.HealthRequest(), timeout=timeout,
                                                        metadata=security.metadata())
                return None
            except grpc.aio.AioRpcError as err:
                return f"{err.code().name}: {err.details()}"

    return list(await asyncio.gather(*(one(a) for a in addresses)))


@dataclass
class Placement:
    """One stage of a pipeline, as the head knows it: where it runs and which layers."""

    address: str
    start: int
    end: int
    load: Optional[pb.LoadReply] = None
    weights_sent: int = 0  # data bytes of weights the head streamed to it


@dataclass
class WeightSource:
    """The head's copy of the model, for nodes that lack it (shards/weights.py)."""

    folder: Path
    fingerprint: str
    num_layers: int
    rate: Optional[float] = None      # bytes per second at most, per node
    corrupt: frozenset = frozenset()  # (unit, chunk) to garble once: for tests of the checksum path
    source_fingerprint: str = ""      # of the full-precision folder, when what is sent is quantized

    def __post_init__(self):
        self.units = model_units(self.folder)
        self.files = {n: (self.folder / n).read_bytes()
                      for n in ("config.json", "generation_config.json") if (self.folder / n).exists()}

    def range_units(self, start: int, end: int) -> List[Unit]:
        """The units a stage with layers ``[start, end)`` needs."""
        return units_for_range(self.units, start, end, self.num_layers)


class QuantizedSource(WeightSource):
    """The head's full-precision model, quantized by ``spec`` for nodes that lack it.

    Units are quantized when a node first needs them, one at a time
    (``shards/quantize.py``: the head never holds the full-precision model), into
    ``$MLXPIPE_HOME/quantized/<fingerprint>/``, a folder keyed by the source's
    fingerprint and the spec; from there they travel like any folder's units.
    One thread of its own does the MLX work (MLX arrays belong to the thread
    that made them), one unit after another.
    """

    def __init__(self, source: Path, source_fingerprint: str, spec: QuantSpec, num_layers: int,
                 rate: Optional[float] = None):
        self.source, self.spec = source, spec
        self._mlx = ThreadPoolExecutor(max_workers=1, thread_name_prefix="quantize")
        config = self._mlx.submit(self._prepare).result()  # a lazy graph: nothing read yet
        fp = quantized_fingerprint(source_fingerprint, spec)
        folder = mlxpipe_home() / "quantized" / fp
        write_config(config, folder)
        super().__init__(folder, fp, num_layers, rate, source_fingerprint=source_fingerprint)

    def _prepare(self) -> dict:
        self._model, config = prepare(self.source, self.spec)
        return config

    def range_units(self, start: int, end: int) -> List[Unit]:
        return self._mlx.submit(self._range_units, start, end).result()

    def _range_units(self, start: int, end: int) -> List[Unit]:
        missing = [u for u in stage_units(self._model, start, end) if u not in self.units]
        if missing:
            logger.info("quantizing %s for layers [%d, %d): %s", self.source, start, end, ", ".join(missing))
            try:
                write_units(self._model, self.folder, missing)
            except QuantizeError:  # written and released before, but its file is gone: start afresh
                self._prepare()
                write_units(self._model, self.folder, missing)
            self.units = model_units(self.folder)
        return units_for_range(self.units, start, end, self.num_layers)

    def close(self) -> None:
        self._mlx.shutdown(wait=False)


class Pipeline:
    """A chain of stages holding one model, driven by the head."""

    def __init__(self, addresses: Sequence[str], model: str, security: Optional[Security] = None,
                 max_batch: int = 0, max_chunk_tokens: int = 0, max_cache_bytes: int = 0,
                 block_tokens: int = 0, tokenizer: Optional[pb.TokenizerSpec] = None):
        self.stages = [Placement(a, 0, 0) for a in addresses]
        self.model = model
        self.security = security or Security()
        self.md = self.security.metadata()  # every call carries the cluster secret
        self.max_batch, self.max_chunk_tokens, self.max_cache_bytes = max_batch, max_chunk_tokens, max_cache_bytes
        self.block_tokens = block_tokens  # prefix-cache block size the stages keep (0: none)
        self.tokenizer = tokenizer  # for the last stage's grammars (None: it refuses sequences with one)
        self.channels = [self.security.channel(a) for a in addresses]
        self.stubs = [pb_grpc.StageStub(c) for c in self.channels]
        self._forward = None
        self._results = None
        self._outbox: asyncio.Queue = asyncio.Queue()
        self._writer: Optional[asyncio.Task] = None

    async def profile(self, indices: Sequence[int], batch: int,
                      quant: Optional[QuantSpec] = None) -> List[pb.ProfileReply]:
        """Ask stages (by index) to time the model (quantized by ``quant``), for the planner."""
        request = pb.ProfileRequest(model=self.model, batch=batch,
                                    quantization=quant.to_wire() if quant else None)

        async def one(i: int) -> pb.ProfileReply:
            try:
                return await self.stubs[i].Profile(request, timeout=LOAD_TIMEOUT_S, metadata=self.md)
            except grpc.aio.AioRpcError as err:
                raise PipelineError(f"stage {i} at {self.stages[i].address} could not profile the model: "
                                    f"{err.code().name}: {err.details()}") from err

        return list(await asyncio.gather(*(one(i) for i in indices)))

    def assign(self, ranges: Sequence[Tuple[int, int]]) -> None:
        """Give stage i the layers ``ranges[i]``."""
        if len(ranges) != len(self.stages):
            raise ValueError(f"{len(ranges)} layer ranges for {len(self.stages)} stages")
        for st, (s, e) in zip(self.stages, ranges):
            st.start, st.end = s, e

    async def send_weights(self, i: int, source: WeightSource, progress: bool = False) -> int:
        """Offer stage i the units of its range; send the chunks it lacks (again, for any
        whose checksum failed). Returns the data bytes sent."""
        import hashlib

        from mlxpipe.shards.weights import CHUNK_BYTES, chunk_size

        st, stub = self.stages[i], self.stubs[i]
        offer = pb.WeightsOffer(model=self.model, fingerprint=source.fingerprint, start=st.start, end=st.end,
                                chunk_bytes=CHUNK_BYTES, files=source.files,
                                source_fingerprint=source.source_fingerprint)
        if source.source_fingerprint:  # quantized units: first ask whether the node quantizes its own copy
            if (await stub.Have(offer, timeout=LOAD_TIMEOUT_S, metadata=self.md)).local:
                return 0
        units = await asyncio.to_thread(source.range_units, st.start, st.end)
        offer.units.extend(pb.WeightUnit(name=u.name, header=u.header(), data_bytes=u.data_bytes) for u in units)
        need = await stub.Have(offer, timeout=LOAD_TIMEOUT_S, metadata=self.md)
        if need.local:
            return 0
        by_name = {u.name: u for u in units}
        todo = [(n.name, list(n.chunks)) for n in need.units]
        total = sum(chunk_size(by_name[n].data_bytes, c) for n, cs in todo for c in cs)
        bar = None
        if progress and total:
            from tqdm import tqdm

            bar = tqdm(total=total, desc=f"weights to {st.address}", unit="B", unit_scale=True, file=sys.stderr)
        sent, t0, garble = 0, time.monotonic(), set(source.corrupt)
        try:
            for _ in range(5):
                if not todo:
                    break

                async def chunks():
                    nonlocal sent
                    for name, indices in todo:
                        for idx in indices:
                            data = await asyncio.to_thread(by_name[name].read, idx, CHUNK_BYTES)
                            digest = hashlib.sha256(data).digest()
                            if (name, idx) in garble:  # as if a bit flipped on the way
                                garble.discard((name, idx))
                                data = bytes([data[0] ^ 0xFF]) + data[1:]
                            sent += len(data)
                            if bar is not None:
                                bar.update(len(data))
                            if source.rate:  # stay under the rate: sleep off any lead
                                ahead = sent / source.rate - (time.monotonic() - t0)
                                if ahead > 0:
                                    await asyncio.sleep(ahead)
                            yield pb.WeightChunk(fingerprint=source.fingerprint, unit=name, index=idx,
                                                 data=data, sha256=digest)

                summary = await stub.Receive(chunks(), timeout=LOAD_TIMEOUT_S, metadata=self.md)
                todo = [(r.name, list(r.chunks)) for r in summary.rejected]
            if todo:
                raise PipelineError(f"chunks for stage {i} at {st.address} kept failing their checksum: {todo}",
                                    [st.address])
        finally:
            if bar is not None:
                bar.close()
        st.weights_sent += sent
        logger.info("sent %.1f MB of weights to %s", sent / 1e6, st.address)
        return sent

    async def load(self, progress: bool = False, weights: Optional[WeightSource] = None,
                   quant: Optional[QuantSpec] = None) -> List[pb.LoadReply]:
        """Every stage loads its range, all at once (a progress bar counts them in).
        With ``weights``, a stage without the model first receives its range's.
        With ``quant``, a stage holding the full-precision model quantizes its range
        as it loads it (and ``weights`` should be a ``QuantizedSource`` of the same spec)."""
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=len(self.stages), desc="loading stages", unit="stage", file=sys.stderr)

        async def one(i: int) -> pb.LoadReply:
            st = self.stages[i]
            nxt = self.stages[i + 1].address if i + 1 < len(self.stages) else ""
            req = pb.LoadRequest(model=self.model, start=st.start, end=st.end, next_address=nxt,
                                 max_batch=self.max_batch, max_chunk_tokens=self.max_chunk_tokens,
                                 max_cache_bytes=self.max_cache_bytes, block_tokens=self.block_tokens,
                                 quantization=quant.to_wire() if quant else None,
                                 tokenizer=self.tokenizer if not nxt else None)
            try:
                if weights is not None:
                    await self.send_weights(i, weights, progress)
                    req.fingerprint = weights.fingerprint
                st.load = await self.stubs[i].Load(req, timeout=LOAD_TIMEOUT_S, metadata=self.md)
                if bar is not None:
                    bar.update()
            except grpc.aio.AioRpcError as err:
                # A stage that cannot reach its successor blames the successor.
                suspect = self.stages[i + 1] if "next stage" in (err.details() or "") else st
                raise PipelineError(
                    f"stage {i} at {st.address} could not load layers [{st.start}, {st.end}): "
                    f"{err.code().name}: {err.details()}", [suspect.address]
                ) from err
            return st.load

        try:
            replies = await asyncio.gather(*(one(i) for i in range(len(self.stages))))
        finally:
            if bar is not None:
                bar.close()
        prints = {r.fingerprint for r in replies}
        if len(prints) != 1:
            raise PipelineError(f"stages hold different models (fingerprints {sorted(prints)})")
        return replies

    async def open(self) -> None:
        """Open the Results stream of the last stage, then the Forward stream of the first."""
        self._results = self.stubs[-1].Results(pb.ResultsRequest(), metadata=self.md)
        self._forward = self.stubs[0].Forward(metadata=self.md)
        self._writer = asyncio.ensure_future(self._write())

    async def _write(self) -> None:
        try:
            while True:
                frame = await self._outbox.get()
                await self._forward.write(frame)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError) as err:
            # The stream broke; watch_forward reports why.
            logger.info("forward stream write failed: %s", err)

    def send(self, frame: pb.Frame) -> None:
        """Queue a frame for stage 0; frames go out in the order sent."""
        self._outbox.put_nowait(frame)

    async def results(self) -> AsyncIterator[pb.Result]:
        """Results from the last stage, until the pipeline breaks (PipelineError)."""
        last = len(self.stages) - 1
        try:
            async for result in self._results:
                yield result
        except grpc.aio.AioRpcError as err:
            raise PipelineError(f"results stream of the last stage at {self.stages[last].address} broke: "
                                f"{err.code().name}: {err.details()}", [self.stages[last].address]) from err
        raise PipelineError("the last stage closed its results stream", [self.stages[last].address])

    async def watch_forward(self) -> None:
        """Return never; raise PipelineError when the Forward stream into stage 0 ends.

        A stage that loses its successor ends its own upstream stream with
        UNAVAILABLE, so a break anywhere along the chain arrives here."""
        try:
            await self._forward
        except grpc.aio.AioRpcError as err:
            raise PipelineError(f"forward stream into stage 0 at {self.stages[0].address} broke: "
                                f"{err.code().name}: {err.details()}", culprits=culprits_of(err)) from err
        raise PipelineError("stage 0 closed the forward stream")

    async def health(self, timeout: float = CALL_TIMEOUT_S) -> List[Tuple[Placement, Optional[pb.HealthReply], str]]:
        """(stage, reply or None, error) for every stage, asked at once."""

        async def one(i: int):
            try:
                reply = await self.stubs[i].Health(pb.HealthRequest(), timeout=timeout, metadata=self.md)
                return self.stages[i], reply, ""
            except grpc.aio.AioRpcError as err:
                return self.stages[i], None, f"{err.code().name}: {err.details()}"
            except grpc.aio.UsageError as err:  # closed under us: a recovery replaced this pipeline
                return self.stages[i], None, f"{err} (the pipeline is being rebuilt)"
            except asyncio.CancelledError:
                # gRPC cancels calls in flight when their channel closes (a recovery
                # replacing this pipeline); only a cancel of the caller itself goes on.
                task = asyncio.current_task()
                if task is not None and getattr(task, "cancelling", lambda: 1)():
                    raise
                return self.stages[i], None, "the call was cancelled: the pipeline is being rebuilt"

        return list(await asyncio.gather(*(one(i) for i in range(len(self.stages)))))

    def held_blocks(self) -> List[List[int]]:
        """The prefix-cache blocks each stage reported holding when it loaded."""
        return [list(st.load.blocks) for st in self.stages]

    async def close(self) -> None:
        if self._writer is not None:
            self._writer.cancel()
        for call in (self._forward, self._results):
            if call is not None:
                call.cancel()
        for ch in self.channels:
            await ch.close()
