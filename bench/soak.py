"""``mlxpipe bench soak``: a bounded soak of ``mlxpipe serve`` through its HTTP API.

For ``--duration`` seconds, ``--clients`` streaming clients send greedy chat
requests of random prompt and answer lengths; some hang up after a few chunks
(``--disconnect``); every ``--kill-every`` seconds one stage process, in turn
from ``--kill-stages``, is killed with SIGKILL (the head restarts it in place).
The same pool of prompts is first answered once with nothing disturbed, and
every answer a client read to its end must equal that one.

Reported: requests finished, disconnected, mismatched; responses by status
(any 5xx, and mid-stream error events); kills; the resident memory of the head
and of each stage process at the start and the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Tuple

import httpx

from mlxpipe.bench.common import HttpServer
from mlxpipe.server.config import ClusterConfig
from mlxpipe.shards.models.store import resolve_model

WORDS = ("river stone light paper garden window music number silver north winter letter field "
         "engine mountain question morning story ocean bridge").split()


# -- the processes behind a server ---------------------------------------------------


def _children(pid: int) -> List[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _listening_ports(pid: int) -> List[int]:
    """TCP ports ``pid`` listens on (Linux: /proc; elsewhere: lsof)."""
    if os.path.exists("/proc/net/tcp"):
        inodes = set()
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
        ports = []
        for table in ("/proc/net/tcp", "/proc/net/tcp6"):
            with open(table) as f:
                for line in f.readlines()[1:]:
                    cols = line.split()
                    if cols[3] == "0A" and cols[9] in inodes:  # LISTEN
                        ports.append(int(cols[1].rsplit(":", 1)[1], 16))
        return ports
    out = subprocess.run(["lsof", "-nP", "-a", "-p", str(pid), "-iTCP", "-sTCP:LISTEN", "-Fn"],
                         capture_output=True, text=True).stdout
    return [int(line.rsplit(":", 1)[1]) for line in out.splitlines() if line.startswith("n")]


def stage_pids(server_pid: int, addresses: List[str]) -> List[Optional[int]]:
    """The process of each stage address (host:port) among ``server_pid``'s children."""
    by_port = {}
    for child in _children(server_pid):
        try:
            for port in _listening_ports(child):
                by_port[port] = child
        except OSError:  # gone meanwhile
            continue
    return [by_port.get(int(a.rsplit(":", 1)[1])) for a in addresses]


def rss_bytes(pid: Optional[int]) -> Optional[int]:
    if pid is None:
        return None
    out = subprocess.run(["ps", "-o", "rss=", "-p", str(pid)], capture_output=True, text=True).stdout.strip()
    return int(out) * 1024 if out else None


# -- clients -------------------------------------------------------------------------


@dataclass
class SoakResult:
    seconds: float
    clients: int
    finished: int = 0
    disconnected: int = 0
    mismatched: int = 0
    statuses: Dict[str, int] = field(default_factory=dict)
    error_events: int = 0
    kills: List[Tuple[float, int]] = field(default_factory=list)   # (seconds in, stage)
    rss_start: Dict[str, Optional[int]] = field(default_factory=dict)
    rss_end: Dict[str, Optional[int]] = field(default_factory=dict)

    @property
    def server_errors(self) -> int:
        return sum(n for s, n in self.statuses.items() if s.startswith("5"))


def _pool(n: int, rng: random.Random, max_tokens: int) -> List[Tuple[str, int]]:
    """``n`` prompts of random length (4 to 300 words) with random answer lengths."""
    return [(f"[{i}] " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 300))), rng.randint(4, max_tokens))
            for i in range(n)]


async def _ask(http, url: str, prompt: str, max_tokens: int, hang_up_after: Optional[int] = None):
    """(status, text or None when hung up, whether the stream ended in an error event)."""
    body = {"model": "default", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True}
    async with http.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            await resp.aread()
            return resp.status_code, None, False
        text, chunks = [], 0
        async for line in resp.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                return 200, None, True
            for choice in event.get("choices") or ():
                text.append((choice.get("delta") or {}).get("content") or "")
            chunks += 1
            if hang_up_after is not None and chunks >= hang_up_after:
                return 200, None, False
        return 200, "".join(text), False


async def _client(http, url, pool, want, rng, deadline, disconnect, result: SoakResult):
    statuses = Counter()
    while time.monotonic() < deadline:
        i = rng.randrange(len(pool))
        prompt, n = pool[i]
        hang_up = rng.randint(1, 4) if rng.random() < disconnect else None
        try:
            status, text, errored = await _ask(http, url, prompt, n, hang_up)
        except httpx.HTTPError as err:
            statuses[type(err).__name__] += 1
            continue
        statuses[str(status)] += 1
        result.error_events += errored
        if hang_up is not None and text is None and not errored:
            result.disconnected += 1
        elif text is not None:
            result.finished += 1
            result.mismatched += text != want[i]
    for k, v in statuses.items():
        result.statuses[k] = result.statuses.get(k, 0) + v


async def _killer(server: HttpServer, stages: List[int], every: float, deadline: float, t0: float,
                  result: SoakResult, http):
    turn = 0
    while time.monotonic() + every < deadline:
        await asyncio.sleep(every)
        stage = stages[turn % len(stages)]
        turn += 1
        addresses = await _addresses(http, server.url)
        pid = stage_pids(server.proc.pid, addresses)[stage]
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
            result.kills.append((round(time.monotonic() - t0, 1), stage))


async def _addresses(http, url: str) -> List[str]:
    return [s["address"] for s in (await http.get(f"{url}/health", timeout=30)).json()["stages"]]


async def _memory(http, server: HttpServer) -> Dict[str, Optional[int]]:
    addresses = await _addresses(http, server.url)
    pids = stage_pids(server.proc.pid, addresses)
    return {"head": rss_bytes(server.proc.pid)} | {f"stage {i}": rss_bytes(p) for i, p in enumerate(pids)}


async def bench_soak(args) -> dict:
    rng = random.Random(args.seed)
    pool = _pool(args.prompts, rng, args.max_tokens)
    cmd = [sys.executable, "-m", "mlxpipe.server.cli", "serve", "--model", str(resolve_model(args.model)),
           "--stages", str(args.stages), "--split", "even", "--port", "0"]
    server = HttpServer("mlxpipe", cmd)
    try:
        limits = httpx.Limits(max_connections=args.clients + 8)
        async with httpx.AsyncClient(timeout=300, limits=limits) as http:
            want = []
            for prompt, n in pool:  # the undisturbed answers
                status, text, _ = await _ask(http, server.url, prompt, n)
                if status != 200 or text is None:
                    raise RuntimeError(f"the undisturbed run failed: HTTP {status}")
                want.append(text)
            result = SoakResult(seconds=args.duration, clients=args.clients)
            result.rss_start = await _memory(http, server)
            t0 = time.monotonic()
            deadline = t0 + args.duration
            kill_stages = [int(s) for s in args.kill_stages.split(",")] if args.kill_stages else \
                list(range(args.stages))
            killer = asyncio.ensure_future(_killer(server, kill_stages, args.kill_every, deadline, t0, result, http)) \
                if args.kill_every > 0 else None
            await asyncio.gather(*(_client(http, server.url, pool, want, random.Random(args.seed + 1 + c), deadline,
                                           args.disconnect, result) for c in range(args.clients)))
            if killer is not None:
                killer.cancel()
            await asyncio.sleep(2)  # let the stages free what the last requests held
            result.rss_end = await _memory(http, server)
    finally:
        server.close()
    _print(result)
    return asdict(result) | {"server_errors": result.server_errors}


def _print(r: SoakResult) -> None:
    mb = lambda b: "-" if b is None else f"{b / 2**20:.0f} MB"  # noqa: E731
    print(f"soak: {r.seconds:.0f} s, {r.clients} clients; {r.finished} answers read to the end "
          f"({r.mismatched} differ from the undisturbed run), {r.disconnected} hung up on purpose")
    print(f"responses by status: {dict(sorted(r.statuses.items()))}; 5xx: {r.server_errors}; "
          f"mid-stream error events: {r.error_events}")
    print(f"kills (s, stage): {r.kills}")
    for name in r.rss_start:
        print(f"  {name:8} RSS {mb(r.rss_start[name])} -> {mb(r.rss_end.get(name))}")


def add_parser(sub: argparse._SubParsersAction) -> None:
    q = sub.add_parser("soak")
    q.add_argument("--model", default=ClusterConfig.model,
                   help="model folder, HF repo id, or 'default' (the embedded one)")
    q.add_argument("--stages", type=int, default=ClusterConfig.stages,
                   help="local stage processes (default %(default)s)")
    q.add_argument("--duration", type=float, default=600, help="seconds of load (default %(default)s)")
    q.add_argument("--clients", type=int, default=16, help="concurrent streaming clients (default %(default)s)")
    q.add_argument("--kill-every", type=float, default=120,
                   help="SIGKILL a stage process this often, in seconds (default %(default)s; 0: never)")
    q.add_argument("--kill-stages", default=None, help="stages to kill in turn, e.g. 0,1 (default: all)")
    q.add_argument("--disconnect", type=float, default=0.1,
                   help="share of requests whose client hangs up after a few chunks (default %(default)s)")
    q.add_argument("--max-tokens", type=int, default=48, help="longest answer asked for (default %(default)s)")
    q.add_argument("--prompts", type=int, default=24, help="prompts in the pool (default %(default)s)")
    q.add_argument("--seed", type=int, default=0, help="seed of the clients' random choices (default %(default)s)")
    q.add_argument("--json", default=None, help="also write the results as JSON to this file")
    q.set_defaults(measure=bench_soak)
