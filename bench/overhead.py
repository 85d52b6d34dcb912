"""``mlxpipe bench overhead``: the pipeline's own cost per token, with the model's work taken out.

The stages run a random llama of negligible weights (hidden size 64, 6 layers,
320 logits, a byte-level tokenizer of its own; built once under
``$MLXPIPE_HOME/models/overhead-llama``), so that a decode step is mostly
pipeline: the head's scheduling and frames, protobuf, gRPC, the event loops and
the hand-offs to each stage's MLX thread. Every frame carries each stage's
timing (``server/core/budget.py``, ``server/cluster/budget.py``), so what remains is split exactly: per decode
frame, the stages' compute and queueing, and the rest (decoding, encoding, the
wire, the head's handling) over the ``stages + 1`` hops of a round trip
(head -> stage 0 -> ... -> last stage -> head): the pipeline's own cost per
hop. Beside it, in the same run:

- the wire's floor: a bidirectional gRPC ping-pong of the same frame bytes (a
  decode frame of as many rows, its activations and stage timings) to a process
  of its own, over the same transport (``proto/rpc.py``'s channel and server
  options and the cluster-secret interceptor); half a round trip is one hop.
  Twice: back to back (hot), and with each end working a stage's compute per
  frame (from the same run) before it sends (idle), so that each frame reaches
  an end that was waiting for it, as in a pipeline: where cores sleep when idle
  (a VM's virtual CPUs), waking one is part of every hop;
- plain mlx-lm's ``generate_step`` on the same model, in a process of its own.

Then the per-token budget of a real model (``--model``, 2 stages): where a
decode token's time goes, from the timings every frame carries
(``server/core/budget.py``, ``server/cluster/budget.py``): each stage's queueing, decoding, compute and encoding,
the wire (the round trip less those) and the head.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

from mlxpipe.bench.common import Baseline, add_common_arguments, decode_window, median, pin_to, window_rate
from mlxpipe.server.cluster.assembly import Cluster
from mlxpipe.server.config import ClusterConfig
from mlxpipe.server.core.budget import STAGE_PARTS, KindTotals
from mlxpipe.shards.models.store import mlxpipe_home, resolve_model

TINY = dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=64, num_hidden_layers=6,
            intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
            vocab_size=320, tie_word_embeddings=True, max_position_embeddings=4096, rope_theta=10000.0,
            eos_token_id=0, torch_dtype="float32")
PROMPT = list(range(1, 17))
ECHO_METHOD = "/mlxpipe.bench.Echo/Echo"
OWN_PARTS = ("decode", "encode", "wire", "head")  # a frame's time that is neither compute nor queueing


def tiny_model() -> Path:
    """The negligible-compute model (made once, kept)."""
    out = mlxpipe_home() / "models" / "overhead-llama"
    if (out / "config.json").exists():
        return out
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.models.llama import Model, ModelArgs
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    mx.random.seed(0)
    model = Model(ModelArgs.from_dict(TINY))
    mx.eval(model.parameters())
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(tmp / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (tmp / "config.json").write_text(json.dumps(TINY, indent=2))
    # A byte-level tokenizer of its own (llguidance, on the last stage, needs a known decoder): the 256
    # bytes and an end-of-sequence token; the model's extra logits are ids no text maps to.
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE({"<eos>": 0} | {ch: i + 1 for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<eos>"])
    tok.save(str(tmp / "tokenizer.json"))
    (tmp / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<eos>", "model_max_length": 4096}))
    tmp.rename(out)
    return out


# -- the floor: a gRPC ping-pong of the same bytes ------------------------------------


WORK_KEY = "mlxpipe-bench-work-us"  # a ping-pong call's metadata: how long each end works between frames


def busy(seconds: float) -> None:
    """Keep this core busy for ``seconds``, as a stage computing a frame does."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def echo_worker(secret: str) -> None:
    """A process that answers each frame of a bidirectional stream with the frame itself,
    parsed and serialized again as a stage does, behind the stages' server options and
    secret check; with the call's ``WORK_KEY`` metadata, after working that long on it.
    Prints its port, serves until stdin closes."""
    import grpc

    from mlxpipe.proto import pipeline_pb2 as pb
    from mlxpipe.proto.rpc import Security, secured_server

    async def echo(frames, context):
        work = int(dict(context.invocation_metadata()).get(WORK_KEY, 0)) / 1e6
        async for frame in frames:
            busy(work)
            yield frame

    async def main() -> None:
        server = secured_server(Security(secret=secret))
        handler = grpc.stream_stream_rpc_method_handler(echo, pb.Frame.FromString, pb.Frame.SerializeToString)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("mlxpipe.bench.Echo",
                                                                              {"Echo": handler}),))
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        print(port, flush=True)
        await asyncio.to_thread(sys.stdin.read)
        await server.stop(None)

    asyncio.run(main())


def decode_frame(rows: int, hidden: int, stages: int):
    """A decode frame as it crosses a hop: ``rows`` rows, their activations (float32,
    as the tiny model's) and the timings of the stages before."""
    import mlx.core as mx

    from mlxpipe.proto import codec
    from mlxpipe.proto import pipeline_pb2 as pb

    frame = pb.Frame(frame_id=1, kind=pb.Frame.DECODE, tokens=[5] * rows,
                     seqs=[pb.SeqEntry(seq_id=i + 1, offset=100, num_tokens=1, sample=True) for i in range(rows)],
                     timings=[pb.StageTiming(queued_us=20, decode_us=30, compute_us=400, encode_us=10)] * stages)
    codec.encode(mx.zeros((rows, 1, hidden), dtype=mx.float32), into=frame.hidden)
    return frame


async def ping_pong(address: str, secret: str, frame, count: int, work: float = 0.0) -> float:
    """Median seconds of one hop: half a round trip of ``frame`` over one stream. With
    ``work``, each end works that long between frames, as stages do, so that each frame
    reaches an end that has waited for it (an idle core, whose waking the wire then
    includes); the work is not counted."""
    from mlxpipe.proto import pipeline_pb2 as pb
    from mlxpipe.proto.rpc import Security

    security = Security(secret=secret)
    async with security.channel(address) as channel:
        call = channel.stream_stream(ECHO_METHOD, request_serializer=pb.Frame.SerializeToString,
                                     response_deserializer=pb.Frame.FromString)(
            metadata=security.metadata() + ((WORK_KEY, str(round(work * 1e6))),))
        trips = []
        for _ in range(count + 20):  # the first 20 warm up
            busy(work)
            t0 = time.perf_counter()
            await call.write(frame)
            await call.read()
            trips.append(time.perf_counter() - t0 - work)
        await call.done_writing()
        return statistics.median(trips[20:]) / 2


class EchoServer:
    def __init__(self, secret: str, cpu):
        cmd = [sys.executable, "-c", f"from mlxpipe.bench.overhead import echo_worker; echo_worker({secret!r})"]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     preexec_fn=pin_to(cpu))
        self.address = f"127.0.0.1:{int(self.proc.stdout.readline())}"

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


# -- the pipeline -----------------------------------------------------------------------


async def run_streams(cluster: Cluster, streams: int, max_tokens: int, prompt: Sequence[int]) -> List[List[float]]:
    """``streams`` requests at once; each one's token arrival times."""

    async def one(i: int) -> List[float]:
        times = []
        ids = [(t + i) % 255 + 1 for t in prompt]  # distinct prompts: no prefix reuse between streams
        async for _ in cluster.engine.submit(ids, max_tokens, stop_at_eos=False, speculation="prompt_lookup"):
            times.append(time.perf_counter())
        return times

    out = await asyncio.gather(*(one(i) for i in range(streams)))
    await cluster.engine.drain()
    return out


def step_seconds(all_times: Sequence[Sequence[float]]) -> float:
    """Median time between a stream's tokens while every stream decodes."""
    window = decode_window(all_times)
    lo, hi = window if window else (0.0, 0.0)
    gaps = [b - a for ts in all_times for a, b in zip(ts[1:], ts[2:]) if lo <= a and b <= hi]
    return median(gaps)


async def start_clusters(path: Path, stage_counts: Sequence[int], args) -> Dict[int, Cluster]:
    """One pipeline per stage count (an even split, speculation off), warmed up."""
    clusters: Dict[int, Cluster] = {}
    try:
        for n in stage_counts:
            clusters[n] = await Cluster(ClusterConfig(model=str(path), stages=n, split="even", speculate=False,
                                                      pin=args.pin)).start()
            await run_streams(clusters[n], 2, 8, PROMPT)  # kernels, streams, caches
    except BaseException:
        await stop_clusters(clusters)
        raise
    return clusters


async def stop_clusters(clusters: Dict[int, Cluster]) -> None:
    for c in clusters.values():
        await c.stop()


async def pipeline_run(cluster: Cluster, streams: int, args) -> Tuple[float, float, KindTotals]:
    """One run: the step between a stream's tokens, the aggregate tokens/s, the decode frames' times."""
    cluster.pipeline.budget.reset()
    times = await run_streams(cluster, streams, args.max_tokens, PROMPT)
    return step_seconds(times), window_rate(times), cluster.pipeline.budget.kinds.get("decode", KindTotals())


def summarize(runs: Sequence[Tuple[float, float, KindTotals]]) -> Dict:
    return {"step_s": median([r[0] for r in runs]), "tokens_per_s": median([r[1] for r in runs]),
            "steps": [r[0] for r in runs], "budget": median_budget([r[2] for r in runs])}


def median_budget(runs: Sequence[KindTotals]) -> Dict:
    """Microseconds per decode frame (one step of a group), medians over runs: each part
    summed over the stages, the wire, the head; per stage; and the rows per frame."""
    runs = [t for t in runs if t.frames]
    if not runs:
        return {}
    means = [t.mean_us("frame") for t in runs]
    out: Dict = {p: median([m[p] for m in means]) for p in means[0]}
    out["rows"] = median([t.tokens / t.frames for t in runs])
    per_stage = [t.stage_us("frame") for t in runs]
    out["stages"] = [[median([st[i][j] for st in per_stage if len(st) > i]) for j in range(len(STAGE_PARTS))]
                     for i in range(max(len(st) for st in per_stage))]
    return out


async def bench_overhead(args) -> dict:
    """Every configuration up at once, measured round-robin (a noisy neighbour slows all alike)."""
    import secrets

    path = tiny_model()
    stage_counts = [int(x) for x in args.stages.split(",")]
    configs = [(n, int(s)) for n in stage_counts for s in args.streams.split(",")]
    frames = {(n, s): decode_frame(-(-s // n), TINY["hidden_size"], n) for n, s in configs}  # a group's rows
    result: Dict = {"model": str(path), "max_tokens": args.max_tokens, "runs": args.runs}
    secret = secrets.token_urlsafe(32)
    echo = EchoServer(secret, 0 if args.pin else None)
    baseline = Baseline(str(path), 0 if args.pin else None)
    clusters: Dict[int, Cluster] = {}
    floors: Dict = {c: [] for c in configs}
    idle_floors: Dict = {c: [] for c in configs}
    runs: Dict = {c: [] for c in configs}
    steps = []
    try:
        clusters = await start_clusters(path, stage_counts, args)
        for _ in range(args.runs):
            steps.append(1 / baseline.run(PROMPT, args.max_tokens).decode_tps)
            for n, s in configs:
                floors[n, s].append(await ping_pong(echo.address, secret, frames[n, s], args.pings))
                runs[n, s].append(await pipeline_run(clusters[n], s, args))
                work = runs[n, s][-1][2].mean_us("frame")["compute"] / n / 1e6  # a stage's compute per frame
                idle_floors[n, s].append(await ping_pong(echo.address, secret, frames[n, s], args.pings, work))
    finally:
        echo.close()
        baseline.close()
        await stop_clusters(clusters)
    mlx_lm_step = median(steps)
    rows = [dict(stages=n, streams=s, floor_hop_s=median(floors[n, s]), idle_floor_hop_s=median(idle_floors[n, s]),
                 **summarize(runs[n, s])) for n, s in configs]
    result.update(mlx_lm_step_s=mlx_lm_step, rows=rows)
    lines = [f"pipeline overhead: a {TINY['num_hidden_layers']}-layer random llama (hidden {TINY['hidden_size']}, "
             f"vocabulary {TINY['vocab_size']}), {args.max_tokens} tokens per stream, medians of {args.runs} runs",
             f"plain mlx-lm's step on the same model: {mlx_lm_step * 1e6:.0f} us per token",
             "step: between a stream's tokens. Per decode frame, summed over the stages: compute; queued (the "
             "hand-off to a stage's MLX thread, and the wait behind other groups' frames); own/hop: the rest of "
             "its time (decoding, encoding, the wire, the head's handling) / hops; floor/hop: half a gRPC round "
             "trip of the same frame bytes, back to back (hot) and with each end working a stage's compute per "
             "frame in between (idle: the frame reaches a waiting end, as in the pipeline)",
             f"{'stages':>6}{'streams':>8}{'rows':>5}{'step us':>9}{'compute':>8}{'queued':>7}{'own/hop':>8}"
             f"{'floor hot':>10}{'ratio':>7}{'floor idle':>11}{'ratio':>7}{'tok/s':>7}"
             "   per frame, us: decode, encode, wire, head"]
    for r in rows:
        b = r["budget"]
        own = sum(b[p] for p in OWN_PARTS) / (r["stages"] + 1)
        r["own_hop_us"] = own
        hot, idle = r["floor_hop_s"] * 1e6, r["idle_floor_hop_s"] * 1e6
        lines.append(f"{r['stages']:6}{r['streams']:8}{b['rows']:5.0f}{r['step_s'] * 1e6:9.0f}{b['compute']:8.0f}"
                     f"{b['queued']:7.0f}{own:8.0f}{hot:10.0f}{own / hot:7.2f}{idle:11.0f}{own / idle:7.2f}"
                     f"{r['tokens_per_s']:7.0f}   " + ", ".join(f"{b[p]:.0f}" for p in OWN_PARTS))
    lines += codec_lines()
    if args.model != "none":
        result["budget"] = await real_budget(args, lines)
    print("\n".join(lines))
    return result


async def real_budget(args, lines: List[str]) -> Dict:
    """The per-token budget of a real model through 2 stages, at each stream count."""
    path = resolve_model(args.model)
    out = {}
    lines.append(f"\nper-token budget of {path.name} through 2 stages, decode, us per token "
                 "(each part summed over the stages):")
    parts = list(STAGE_PARTS) + ["wire", "head"]
    lines.append(f"{'streams':>8}" + "".join(f"{p:>9}" for p in parts) + f"{'token':>9}   per stage (q/d/c/e)")
    streams = [int(x) for x in args.streams.split(",")]
    clusters = await start_clusters(path, [2], args)
    try:
        measured = {s: [] for s in streams}
        for _ in range(args.runs):
            for s in streams:
                measured[s].append(await pipeline_run(clusters[2], s, args))
    finally:
        await stop_clusters(clusters)
    for s in streams:
        m = summarize(measured[s])
        b = m["budget"]
        per_token = {p: b[p] / b["rows"] for p in parts}
        out[s] = dict(per_token, step_s=m["step_s"], rows=b["rows"], stages=b["stages"])
        stages = "  ".join("/".join(f"{v / b['rows']:.0f}" for v in st) for st in b["stages"])
        lines.append(f"{s:8}" + "".join(f"{per_token[p]:9.0f}" for p in parts)
                     + f"{b['round_trip'] / b['rows'] + b['head'] / b['rows']:9.0f}   {stages}")
    return out


def codec_lines() -> List[str]:
    """What the codec takes per activation tensor: encoding into a frame, decoding with its checks."""
    import timeit

    import mlx.core as mx

    from mlxpipe.proto import codec
    from mlxpipe.proto import pipeline_pb2 as pb

    lines = ["codec, us per tensor (encode into a frame / decode with its checks):"]
    for shape in ((8, 1, 7168), (1, 256, 7168)):
        cells = []
        for dtype in (mx.bfloat16, mx.float32):
            x = mx.random.normal(shape).astype(dtype)
            mx.eval(x)
            t = codec.encode(x)
            n = 1000 if shape[1] == 1 else 50
            enc = min(timeit.repeat(lambda: codec.encode(x, into=pb.Frame().hidden), number=n, repeat=5)) / n
            dec = min(timeit.repeat(lambda: codec.decode(t, expect_shape=shape), number=n, repeat=5)) / n
            cells.append(f"{str(dtype).rsplit('.', 1)[-1]} {enc * 1e6:.0f} / {dec * 1e6:.0f}")
        lines.append(f"  {str(list(shape)):15} " + ", ".join(cells))
    return lines


async def measure(args) -> dict:
    return await bench_overhead(args)


def add_parser(sub: argparse._SubParsersAction) -> None:
    q = add_common_arguments(sub.add_parser("overhead"))
    q.add_argument("--stages", default="2,3", help="stage counts to measure")
    q.add_argument("--streams", default="1,8", help="concurrent streams to measure")
    q.add_argument("--max-tokens", type=int, default=128, help="tokens per stream per run")
    q.add_argument("--pings", type=int, default=500, help="round trips per floor measurement")
    q.set_defaults(measure=measure)
