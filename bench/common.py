"""What the benchmark modes share: statistics, the plain mlx-lm baseline process,
a server process speaking the OpenAI API, and prompts."""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import List, Optional, Sequence, Tuple

import httpx
import mlx.core as mx
from tqdm import tqdm

from mlxpipe.server.config import ClusterConfig
from mlxpipe.server.core.drafting import DEFAULT_SPECULATION

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


def window_tokens(all_times: Sequence[Sequence[float]]) -> int:
    """Tokens inside the ``decode_window`` (0: none): few, and the aggregate is rough."""
    window = decode_window(all_times)
    if window is None:
        return 0
    return sum(1 for ts in all_times for t in ts if window[0] < t <= window[1])


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
    """A progress bar on a terminal, else None."""
    if not sys.stderr.isatty():
        return None
    return tqdm(total=total, desc=desc, unit="run", file=sys.stderr)


# -- plain mlx-lm in a process of its own ------------------------------------------


@dataclass
class RunResult:
    prompt_tokens: int
    generated: int
    ttft_s: float          # submit -> first token
    decode_tps: float      # tokens after the first / time after the first
    tokens: List[int] = field(default_factory=list)  # what was generated


def baseline_worker(model: str) -> None:
    """Read JSON requests on stdin, run plain mlx-lm ``generate_step`` (or, with a
    ``draft`` model, mlx-lm's ``speculative_generate_step``), answer JSON."""
    import mlx_lm
    from mlx_lm.generate import generate_step, speculative_generate_step

    model_obj, _ = mlx_lm.load(model)
    drafts = {}
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        prompt = mx.array(req["prompt"])
        if req.get("draft"):
            if req["draft"] not in drafts:
                drafts[req["draft"]] = mlx_lm.load(req["draft"])[0]
            steps = speculative_generate_step(prompt, model_obj, drafts[req["draft"]], max_tokens=req["max_tokens"],
                                              num_draft_tokens=req["num_draft_tokens"])
        else:
            steps = generate_step(prompt, model_obj, max_tokens=req["max_tokens"],
                                  prefill_step_size=req.get("prefill_step_size") or 2048)
        t0 = time.monotonic()
        times, tokens = [], []
        for step in steps:
            times.append(time.monotonic())
            tokens.append(int(step[0]))
        print(json.dumps(asdict(RunResult(len(req["prompt"]), len(times), times[0] - t0,
                                          decode_rate(times), tokens))), flush=True)


class Baseline:
    """mlx-lm ``generate_step`` in its own process (pinned to ``cpu``, as the servers are)."""

    def __init__(self, model: str, cpu: Optional[int]):
        self.proc = subprocess.Popen([sys.executable, "-m", "mlxpipe.bench.command", "--baseline-worker", model],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     preexec_fn=pin_to(cpu))
        if not self.proc.stdout.readline():
            raise RuntimeError("the mlx-lm baseline process failed to start")

    def run(self, prompt: List[int], max_tokens: int, draft: Optional[str] = None,
            num_draft_tokens: int = 3, prefill_step_size: Optional[int] = None) -> RunResult:
        """``prefill_step_size``: mlx-lm's prompt chunk (None: its default, 2048)."""
        self.proc.stdin.write(json.dumps({"prompt": prompt, "max_tokens": max_tokens, "draft": draft,
                                          "num_draft_tokens": num_draft_tokens,
                                          "prefill_step_size": prefill_step_size}) + "\n")
        self.proc.stdin.flush()
        return RunResult(**json.loads(self.proc.stdout.readline()))

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


async def pipeline_run(cluster, prompt: List[int], max_tokens: int,
                       speculation: str = DEFAULT_SPECULATION) -> RunResult:
    t0 = time.monotonic()
    times, tokens = [], []
    # Like mlx-lm's generate_step, do not stop at end-of-sequence: both sides
    # generate exactly max_tokens tokens.
    async for token in cluster.engine.submit(prompt, max_tokens, stop_at_eos=False, speculation=speculation):
        times.append(time.monotonic())
        tokens.append(token.id)
    await cluster.engine.drain()
    return RunResult(len(prompt), len(times), times[0] - t0, decode_rate(times), tokens)


def chat_prompt(tok, text: str) -> List[int]:
    return tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)


def long_text(tok, tokens: int, tag: str = "") -> str:
    """A text of about ``tokens`` tokens (distinct per ``tag``, so no cache can reuse it)."""
    text = f"Document {tag}. "
    while len(tok.encode(text)) < tokens:
        text += FILLER
    ids = tok.encode(text)[:tokens]
    return tok.decode(ids)


# -- servers over HTTP ----------------------------------------------------------------


class HttpServer:
    """A server process speaking the OpenAI API: ``mlxpipe serve`` or ``mlx_lm.server``."""

    def __init__(self, name: str, cmd: List[str], cpu: Optional[int] = None, port: Optional[int] = None,
                 env: Optional[dict] = None, log: Optional[str] = None):
        """``log``: a file for the server's stderr (its log; mlxpipe's request lines), else dropped."""
        self.name = name
        err = open(log, "w") if log else subprocess.DEVNULL
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True,
                                     preexec_fn=pin_to(cpu), env=env)
        if log:
            err.close()  # the child has its own descriptor
        if port is None:  # mlxpipe serve --port 0 prints where it listens
            line = self.proc.stdout.readline()
            if " on http" not in line:
                raise RuntimeError(f"{name} failed to start: {line!r}")
            self.url = line.split(" on ")[1].strip().removesuffix("/v1")
        else:
            self.url = f"http://127.0.0.1:{port}"
        self._wait_ready()

    def _wait_ready(self, timeout: float = 300) -> None:
        if not answering(self.proc, f"{self.url}/v1/models", timeout, every=0.3):
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}")
            raise RuntimeError(f"{self.name} never became ready")

    def cpu_seconds(self) -> float:
        """CPU time the server process itself has used (not its stage processes):
        for mlxpipe, the head's scheduling, frames, detokenizing and HTTP."""
        if self.proc is None or not os.path.exists(f"/proc/{self.proc.pid}/stat"):
            return float("nan")  # --url (not ours to measure), or no /proc (macOS)
        with open(f"/proc/{self.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime

    @classmethod
    def running(cls, name: str, url: str) -> "HttpServer":
        """A server already running at ``url`` (``--url``): measured, never started or stopped."""
        server = cls.__new__(cls)
        server.name, server.url, server.proc = name, url.removesuffix("/v1"), None
        return server

    @classmethod
    def mlx_lm(cls, path: str, pin: Optional[bool]) -> "HttpServer":
        """``mlx_lm.server`` on ``path`` (on core 0 when pinned): the baseline."""
        port = free_port()
        return cls("mlx_lm.server", [sys.executable, "-m", "mlx_lm", "server", "--model", path,
                                     "--port", str(port), "--log-level", "WARNING"], cpu=0 if pin else None, port=port)

    def close(self) -> None:
        if self.proc is None:  # not ours
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def answering(proc: subprocess.Popen, url: str, timeout: float, every: float) -> bool:
    """Whether ``url`` answers 200 within ``timeout`` seconds while ``proc`` runs (False: the
    time ran out, or the process exited)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(url, timeout=5).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(every)
    return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def stream_chat(http: httpx.AsyncClient, url: str, body: dict, name: str = "") -> Tuple[List[float], str, dict]:
    """One streamed chat completion (``body`` without ``stream``): when each content
    piece arrived, the text, and the usage the server reported."""
    body = dict(body, stream=True, stream_options={"include_usage": True})
    times, text, usage = [], [], {}
    async with http.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"{name or url}: HTTP {resp.status_code}: {await resp.aread()}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            usage = event.get("usage") or usage
            for choice in event.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    times.append(time.monotonic())
                    text.append(piece)
    return times, "".join(text), usage


def pin_flags(pin) -> List[str]:
    """``mlxpipe serve``'s option for the bench's --pin/--no-pin (none: serve's default)."""
    return [] if pin is None else ["--pin" if pin else "--no-pin"]


def add_common_arguments(q: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options every mode takes."""
    q.add_argument("--model", default=ClusterConfig.model,
                   help="model folder, HF repo id, or 'default' (the embedded one)")
    q.add_argument("--runs", type=int, default=3, help="runs per configuration; medians are reported")
    q.add_argument("--pin", action=argparse.BooleanOptionalAction, default=None,
                   help="--pin: stage i pinned to CPU core i and each baseline to core 0; --no-pin: the OS places "
                        "everything; default: stages placed as `mlxpipe serve` places them (pinned where each has a "
                        "core of its own), baselines as a user runs mlx-lm (unpinned)")
    q.add_argument("--json", default=None, help="also write the results as JSON to this file")
    return q


def measured_mix(url: str) -> list:
    """The head's measured workload and the splits it implies (its /health), as lines: the
    measured-mix split beside the decode-only one (server/cluster/mix.py)."""
    import httpx

    try:
        workload = httpx.get(f"{url.removesuffix('/v1')}/health", timeout=30).json().get("workload") or {}
    except httpx.HTTPError as err:
        return [f"measured mix: the head did not answer ({err})"]
    return workload.get("lines", ["measured mix: the head reports none"])
