"""``mlxpipe bench``: the pipeline's speed beside plain mlx-lm, measured side by side.

Modes (``mlxpipe bench MODE --help`` for options):

- ``stream``  one stream: mlx-lm ``generate_step`` in its own process vs the
  pipeline at 1, 2, 3 stages, decode tokens/s.
- ``load``    concurrent streaming clients through the HTTP API: ``mlxpipe
  serve`` vs ``mlx_lm.server`` (its own continuous batching) at each
  concurrency level: time to first token (p50, p95), per-stream and aggregate
  decode tokens/s, each stage's busy fraction; JSON and a PNG chart.
- ``prefill`` time to first token of a long prompt, chunked prefill vs not.
- ``balance`` per-stage time per decode step under load: the planner's split
  vs the even split.

Every configuration is started once and kept up; runs go round-robin so that
a noisy machine slows all of them alike. Figures are medians; ratios compare
configurations measured in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

logger = logging.getLogger(__name__)

DEFAULT_PROMPT = "Why is the sky blue? Explain it to a curious ten-year-old."
FILLER = ("The history of the river valley is a long story of farms, floods, bridges, markets and the "
          "people who lived there across many generations. ")


def median(xs: Sequence[float]) -> float:
    xs = [x for x in xs if x == x]
    return statistics.median(xs) if xs else float("nan")


def percentile(xs: Sequence[float], q: float) -> float:
    xs = sorted(x for x in xs if x == x)
    if not xs:
        return float("nan")
    k = min(len(xs) - 1, max(0, int(round(q * (len(xs) - 1)))))
    return xs[k]


def decode_rate(times: Sequence[float]) -> float:
    """Tokens after the first per second after the first."""
    return (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 and times[-1] > times[0] else float("nan")


def decode_window(all_times: Sequence[Sequence[float]]) -> Optional[Tuple[float, float]]:
    """While every stream is decoding: from the last first token to the first last
    token (None when no stream produced any)."""
    started = [ts for ts in all_times if ts]
    if not started:
        return None
    return max(ts[0] for ts in started), min(ts[-1] for ts in started)


def window_rate(all_times: Sequence[Sequence[float]]) -> float:
    """Aggregate decode tokens/s over the ``decode_window``."""
    window = decode_window(all_times)
    if window is None or window[1] - window[0] < 1e-3:
        return float("nan")
    lo, hi = window
    return sum(1 for ts in all_times for t in ts if lo < t <= hi) / (hi - lo)


def pin_to(cpu: Optional[int]):
    """A preexec_fn pinning a child process to one core (Linux)."""
    if cpu is None or not hasattr(os, "sched_setaffinity"):
        return None
    return lambda: os.sched_setaffinity(0, {cpu})


def progress_bar(total: int, desc: str):
    if not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="run", file=sys.stderr)


# -- plain mlx-lm in a process of its own ------------------------------------------


@dataclass
class RunResult:
    prompt_tokens: int
    generated: int
    ttft_s: float          # submit -> first token
    decode_tps: float      # tokens after the first / time after the first


def baseline_worker(model: str) -> None:
    """Read JSON requests on stdin, run plain mlx-lm ``generate_step``, answer JSON."""
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step

    model_obj, _ = load(model)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        t0 = time.monotonic()
        times = []
        for _token, _ in generate_step(mx.array(req["prompt"]), model_obj, max_tokens=req["max_tokens"]):
            times.append(time.monotonic())
        print(json.dumps(asdict(RunResult(len(req["prompt"]), len(times), times[0] - t0,
                                          decode_rate(times)))), flush=True)


class Baseline:
    """mlx-lm ``generate_step`` in its own process (pinned to ``cpu``, as the servers are)."""

    def __init__(self, model: str, cpu: Optional[int]):
        self.proc = subprocess.Popen([sys.executable, "-m", "mlxpipe.server.bench", "--baseline-worker", model],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     preexec_fn=pin_to(cpu))
        if not self.proc.stdout.readline():
            raise RuntimeError("the mlx-lm baseline process failed to start")

    def run(self, prompt: List[int], max_tokens: int) -> RunResult:
        self.proc.stdin.write(json.dumps({"prompt": prompt, "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()
        return RunResult(**json.loads(self.proc.stdout.readline()))

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


async def pipeline_run(cluster, prompt: List[int], max_tokens: int) -> RunResult:
    t0 = time.monotonic()
    times = []
    # Like mlx-lm's generate_step, do not stop at end-of-sequence: both sides
    # generate exactly max_tokens tokens.
    async for _ in cluster.engine.submit(prompt, max_tokens, stop_at_eos=False):
        times.append(time.monotonic())
    await cluster.engine.drain()
    return RunResult(len(prompt), len(times), times[0] - t0, decode_rate(times))


def chat_prompt(tok, text: str) -> List[int]:
    return tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)


def long_text(tok, tokens: int, tag: str = "") -> str:
    """A text of about ``tokens`` tokens (distinct per ``tag``, so no cache can reuse it)."""
    text = f"Document {tag}. "
    while len(tok.encode(text)) < tokens:
        text += FILLER
    ids = tok.encode(text)[:tokens]
    return tok.decode(ids)


# -- stream --------------------------------------------------------------------------


async def bench_stream(args) -> dict:
    from mlxpipe.server.cluster import Cluster, ClusterConfig
    from mlxpipe.shards.store import resolve_model

    path = str(resolve_model(args.model))
    counts = [int(x) for x in args.stages.split(",")]
    clusters = {}
    baseline = Baseline(path, 0 if args.pin else None)
    try:
        for n in counts:
            clusters[n] = await Cluster(ClusterConfig(model=path, stages=n, pin=args.pin)).start()
        prompt = chat_prompt(clusters[counts[0]].tokenizer, args.prompt)
        series: Dict[str, List[RunResult]] = {"mlx-lm": []}
        series.update({f"{n} stage{'s' if n > 1 else ''}": [] for n in counts})
        bar = progress_bar(args.runs * len(series), "stream")
        for _ in range(args.runs):
            series["mlx-lm"].append(baseline.run(prompt, args.max_tokens))
            for n, name in zip(counts, list(series)[1:]):
                series[name].append(await pipeline_run(clusters[n], prompt, args.max_tokens))
            if bar:
                bar.update(len(series))
        if bar:
            bar.close()
    finally:
        baseline.close()
        for c in clusters.values():
            await c.stop()
    base = median([r.decode_tps for r in series["mlx-lm"]])
    lines = [f"one stream, {len(prompt)} prompt tokens, {args.max_tokens} generated, {args.runs} runs each",
             f"{'':24}{'decode tok/s':>13}{'ratio':>8}{'TTFT s':>9}   runs (decode tok/s)"]
    for name, runs in series.items():
        tps = median([r.decode_tps for r in runs])
        lines.append(f"{name:24}{tps:13.2f}{tps / base:8.3f}{median([r.ttft_s for r in runs]):9.2f}   "
                     + " ".join(f"{r.decode_tps:.2f}" for r in runs))
    print("\n".join(lines))
    return {name: [asdict(r) for r in runs] for name, runs in series.items()}


# -- load: concurrent clients over HTTP ---------------------------------------------


class HttpServer:
    """A server process speaking the OpenAI API: ``mlxpipe serve`` or ``mlx_lm.server``."""

    def __init__(self, name: str, cmd: List[str], cpu: Optional[int] = None, port: Optional[int] = None):
        self.name = name
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                     preexec_fn=pin_to(cpu))
        if port is None:  # mlxpipe serve --port 0 prints where it listens
            line = self.proc.stdout.readline()
            if " on http" not in line:
                raise RuntimeError(f"{name} failed to start: {line!r}")
            self.url = line.split(" on ")[1].strip().removesuffix("/v1")
        else:
            self.url = f"http://127.0.0.1:{port}"
        self._wait_ready()

    def _wait_ready(self, timeout: float = 300) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}")
            try:
                if httpx.get(f"{self.url}/v1/models", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"{self.name} never became ready")

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LoadRound:
    server: str
    concurrency: int
    ttft_s: List[float]
    stream_tps: List[float]
    aggregate_tps: float
    busy: List[float] = field(default_factory=list)  # per stage, over the decode window


async def _stage_busy_sampler(http, url: str, samples: list, stop: asyncio.Event) -> None:
    while not stop.is_set():
        try:
            h = (await http.get(f"{url}/health", timeout=10)).json()
            samples.append((time.monotonic(), [s.get("busy_seconds", 0.0) for s in h["stages"]]))
        except Exception:  # noqa: BLE001 - a missed sample only widens the estimate
            pass
        await asyncio.sleep(0.5)


def _busy_between(samples: list, lo: float, hi: float) -> List[float]:
    inside = [s for s in samples if lo <= s[0] <= hi]
    if len(inside) < 2:
        return []
    (t0, b0), (t1, b1) = inside[0], inside[-1]
    return [(y - x) / (t1 - t0) for x, y in zip(b0, b1)]


async def load_round(server: HttpServer, model: str, prompts: List[str], max_tokens: int,
                     eos: List[int], sample_busy: bool) -> LoadRound:
    import httpx

    async def one(http, text):
        body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
                "temperature": 0, "stream": True, "logit_bias": {str(e): -100 for e in eos}}
        t0 = time.monotonic()
        times = []
        async with http.stream("POST", f"{server.url}/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                raise RuntimeError(f"{server.name}: HTTP {resp.status_code}: {await resp.aread()}")
            async for line in resp.aiter_lines():
                if line.startswith("data: {"):
                    choices = json.loads(line[6:]).get("choices") or [{}]
                    if (choices[0].get("delta") or {}).get("content"):
                        times.append(time.monotonic())
        return t0, times

    samples: list = []
    stop = asyncio.Event()
    limits = httpx.Limits(max_connections=len(prompts) + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        sampler = asyncio.ensure_future(_stage_busy_sampler(http, server.url, samples, stop)) if sample_busy else None
        results = await asyncio.gather(*(one(http, p) for p in prompts))
        stop.set()
        if sampler:
            await sampler
    all_times = [ts for _, ts in results]
    window = decode_window(all_times)
    return LoadRound(server.name, len(prompts), [ts[0] - t0 for t0, ts in results if ts],
                     [decode_rate(ts) for ts in all_times], window_rate(all_times),
                     _busy_between(samples, *window) if sample_busy and window else [])


async def bench_load(args) -> dict:
    import httpx
    from mlx_lm.utils import load_tokenizer

    from mlxpipe.shards.store import resolve_model

    path = str(resolve_model(args.model))
    tok = load_tokenizer(path)
    levels = [int(x) for x in args.concurrency.split(",")]
    servers: List[HttpServer] = []
    baseline = None
    try:
        if args.url:
            ours = HttpServer.__new__(HttpServer)
            ours.name, ours.url, ours.proc = "mlxpipe", args.url.removesuffix("/v1"), None
        else:
            cmd = [sys.executable, "-m", "mlxpipe.server.cli", "serve", "--port", "0", "--model", path,
                   "--stages", str(args.stages), "--max-tokens", str(args.max_tokens)]
            if args.pin:
                cmd.append("--pin")
            ours = HttpServer("mlxpipe", cmd)
            servers.append(ours)
        stages = len(httpx.get(f"{ours.url}/health", timeout=30).json()["stages"])  # what it runs (--url: any count)
        port = free_port()
        theirs = HttpServer("mlx_lm.server", [sys.executable, "-m", "mlx_lm", "server", "--model", path,
                                               "--port", str(port), "--log-level", "WARNING"],
                            cpu=0 if args.pin else None, port=port)
        servers.append(theirs)
        baseline = Baseline(path, 0 if args.pin else None)
        eos = sorted(tok.eos_token_ids)
        rounds: List[LoadRound] = []
        single: List[RunResult] = []
        bar = progress_bar(args.runs * (2 * len(levels) + 1), "load")
        for r in range(args.runs):
            single.append(baseline.run(chat_prompt(tok, long_text(tok, args.prompt_tokens, f"s{r}")),
                                       args.max_tokens))
            if bar:
                bar.update()
            for c in levels:
                for server in (ours, theirs):
                    prompts = [long_text(tok, args.prompt_tokens, f"{server.name}-{r}-{c}-{i}")
                               for i in range(c)]
                    rounds.append(await load_round(server, "default" if server is ours else path, prompts,
                                                   args.max_tokens, eos, sample_busy=server is ours))
                    if bar:
                        bar.update()
        if bar:
            bar.close()
    finally:
        if baseline:
            baseline.close()
        for s in servers:
            s.close()

    def agg(name, c, attr):
        return [getattr(x, attr) for x in rounds if x.server == name and x.concurrency == c]

    table = []
    single_tps = median([s.decode_tps for s in single])
    lines = [f"{args.prompt_tokens}-token prompts, {args.max_tokens} tokens each, {args.runs} runs per level; "
             f"mlx-lm generate (1 process, 1 stream): {single_tps:.2f} decode tok/s",
             f"{'server':15}{'streams':>8}{'TTFT p50':>10}{'TTFT p95':>10}{'stream tok/s':>14}"
             f"{'aggregate tok/s':>17}{'vs mlx_lm.server':>18}   stage busy"]
    for c in levels:
        base = median(agg("mlx_lm.server", c, "aggregate_tps"))
        for name in ("mlxpipe", "mlx_lm.server"):
            ttft = [t for xs in agg(name, c, "ttft_s") for t in xs]
            stream = [t for xs in agg(name, c, "stream_tps") for t in xs]
            aggregate = median(agg(name, c, "aggregate_tps"))
            busy_runs = [b for b in agg(name, c, "busy") if b]
            busy = [median(col) for col in zip(*busy_runs)] if busy_runs else []
            row = {"server": name, "concurrency": c, "ttft_p50": percentile(ttft, 0.5),
                   "ttft_p95": percentile(ttft, 0.95), "stream_tps": median(stream), "aggregate_tps": aggregate,
                   "ratio_vs_mlx_lm_server": aggregate / base, "stage_busy": busy}
            table.append(row)
            lines.append(f"{name:15}{c:8d}{row['ttft_p50']:10.2f}{row['ttft_p95']:10.2f}{row['stream_tps']:14.2f}"
                         f"{aggregate:17.2f}{aggregate / base:18.2f}   "
                         + " ".join(f"{b:.0%}" for b in busy))
    lines.append(f"one stream vs mlx-lm generate: {median(agg('mlxpipe', levels[0], 'aggregate_tps')) / single_tps:.3f}"
                 if levels[0] == 1 else "")
    print("\n".join(line for line in lines if line))
    result = {"stages": stages, "levels": table, "mlx_lm_generate_decode_tps": single_tps,
              "rounds": [asdict(r) for r in rounds], "single": [asdict(s) for s in single]}
    if args.chart:
        chart(result, args.chart)
        print(f"chart: {args.chart}")
    return result


def chart(result: dict, path: str) -> None:
    """Aggregate decode tokens/s against concurrency, ours beside the baselines."""
    try:
        import matplotlib
    except ImportError:
        print("no chart: matplotlib is not installed (pip install -e '.[bench]')", file=sys.stderr)
        return
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, style in (("mlxpipe", "o-"), ("mlx_lm.server", "s--")):
        rows = [r for r in result["levels"] if r["server"] == name]
        ax.plot([r["concurrency"] for r in rows], [r["aggregate_tps"] for r in rows], style, label=name)
    ax.axhline(result["mlx_lm_generate_decode_tps"], color="gray", linestyle=":",
               label="mlx-lm generate, one stream")
    ax.set_xscale("log", base=2)
    levels = sorted({r["concurrency"] for r in result["levels"]})
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.set_xlabel("concurrent streams")
    ax.set_ylabel("aggregate decode tokens/s (median)")
    ax.set_title(f"mlxpipe ({result['stages']} stages) vs mlx_lm.server, same model")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# -- prefill: chunked vs not ---------------------------------------------------------


async def bench_prefill(args) -> dict:
    from mlxpipe.server.cluster import Cluster, ClusterConfig
    from mlxpipe.shards.store import resolve_model

    path = str(resolve_model(args.model))
    configs = {"chunked": args.chunk_size, "unchunked": 1 << 16}
    clusters = {}
    try:
        for name, chunk in configs.items():
            clusters[name] = await Cluster(ClusterConfig(model=path, stages=args.stages, pin=args.pin,
                                                         chunk_size=chunk)).start()
        tok = clusters["chunked"].tokenizer
        ttft: Dict[str, List[float]] = {n: [] for n in configs}
        for r in range(args.runs):
            for name, cluster in clusters.items():
                prompt = chat_prompt(tok, long_text(tok, args.prompt_tokens, f"{name}-{r}"))
                ttft[name].append((await pipeline_run(cluster, prompt, 2)).ttft_s)
    finally:
        for c in clusters.values():
            await c.stop()
    a, b = median(ttft["chunked"]), median(ttft["unchunked"])
    print(f"time to first token, {args.prompt_tokens}-token prompt, {args.stages} stages, {args.runs} runs:\n"
          f"  chunked ({args.chunk_size} tokens per frame): {a:.2f} s   runs {[round(x, 2) for x in ttft['chunked']]}\n"
          f"  unchunked:                         {b:.2f} s   runs {[round(x, 2) for x in ttft['unchunked']]}\n"
          f"  ratio: {a / b:.3f}")
    return {"chunk_size": args.chunk_size, "ttft": ttft, "ratio": a / b}


# -- balance: per-stage step time under load ----------------------------------------------


async def bench_balance(args) -> dict:
    from mlxpipe.server.cluster import Cluster, ClusterConfig
    from mlxpipe.shards.store import resolve_model

    path = str(resolve_model(args.model))
    out = {}
    for split in ("auto", "even"):
        async with Cluster(ClusterConfig(model=path, stages=args.stages, pin=args.pin, split=split)) as cluster:
            tok = cluster.tokenizer
            prompts = [tok.encode(f"Item {i}: ") for i in range(args.streams)]
            streams = [cluster.engine.submit(p, 100000, stop_at_eos=False) for p in prompts]
            consumers = [asyncio.ensure_future(_drain(s)) for s in streams]
            await asyncio.sleep(args.warmup)
            before = await cluster.pipeline.health()
            await asyncio.sleep(args.seconds)
            after = await cluster.pipeline.health()
            for s in streams:
                s.cancel()
            await asyncio.gather(*consumers, return_exceptions=True)
            per_step, busy = [], []
            for (_, h0, _), (_, h1, _) in zip(before, after):
                spent = h1.stats.busy_seconds - h0.stats.busy_seconds
                per_step.append(spent / max(h1.stats.frames - h0.stats.frames, 1))
                busy.append(spent / args.seconds)
            ranges = [(st.start, st.end) for st in cluster.pipeline.stages]
            spread = (max(per_step) - min(per_step)) / max(per_step)
            out[split] = {"ranges": ranges, "step_seconds": per_step, "busy": busy, "spread": spread}
            print(f"{split:5} split {ranges}: per-stage seconds per decode step "
                  f"{[round(x * 1000, 1) for x in per_step]} ms, spread {spread:.1%}, "
                  f"busy {[f'{b:.0%}' for b in busy]}")
    return out


async def _drain(stream) -> None:
    async for _ in stream:
        pass


# -- the command -------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="mode", required=True, metavar="MODE")

    def common(q, stages="2"):
        q.add_argument("--model", default="default")
        q.add_argument("--runs", type=int, default=3, help="runs per configuration; medians are reported")
        q.add_argument("--pin", action="store_true", help="pin stage i (and each baseline) to CPU core i")
        q.add_argument("--json", default=None, help="also write the results as JSON to this file")
        return q

    q = common(sub.add_parser("stream", help="one stream: mlx-lm vs the pipeline at 1, 2, 3 stages"))
    q.add_argument("--stages", default="1,2,3", help="stage counts to measure")
    q.add_argument("--max-tokens", type=int, default=64)
    q.add_argument("--prompt", default=DEFAULT_PROMPT)

    q = common(sub.add_parser("load", help="concurrent HTTP clients: mlxpipe serve vs mlx_lm.server"))
    q.add_argument("--stages", type=int, default=2)
    q.add_argument("--concurrency", default="1,2,4,8", help="concurrency levels")
    q.add_argument("--prompt-tokens", type=int, default=64)
    q.add_argument("--max-tokens", type=int, default=48)
    q.add_argument("--url", default=None, help="drive this running mlxpipe server instead of starting one")
    q.add_argument("--chart", default="bench-out/load.png", help="PNG chart to write ('' for none)")

    q = common(sub.add_parser("prefill", help="time to first token of a long prompt: chunked prefill vs not"))
    q.add_argument("--stages", type=int, default=2)
    q.add_argument("--prompt-tokens", type=int, default=1500)
    q.add_argument("--chunk-size", type=int, default=256)

    q = common(sub.add_parser("balance", help="per-stage step time under load: planner split vs even split"))
    q.add_argument("--stages", type=int, default=2)
    q.add_argument("--streams", type=int, default=8)
    q.add_argument("--warmup", type=float, default=10.0, help="seconds before measuring")
    q.add_argument("--seconds", type=float, default=30.0, help="seconds measured")


def run(args) -> int:
    fn = {"stream": bench_stream, "load": bench_load, "prefill": bench_prefill, "balance": bench_balance}
    result = asyncio.run(fn[args.mode](args))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--baseline-worker":
        baseline_worker(argv[1])
        return 0
    parser = argparse.ArgumentParser(prog="mlxpipe bench")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
