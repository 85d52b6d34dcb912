"""``mlxpipe bench chat --restart``: an agent's session across restarts, carried by the
prefix cache's disk tier.

An agent pattern: a long fixed prefix (``--prefix-tokens``: a system prompt and a file)
and turns that grow it (each adds a tool result of ``--turn-tokens`` tokens, a question
and the answer). Three runs of it, greedy, each on texts of its own:

- ``cache off``: ``serve --prefix-cache-bytes 0``, every prompt computed;
- ``restarts``: ``serve`` killed (SIGKILL: its stages finish their disk writes as they
  see it gone) and started again before every turn: nothing is in memory, every hit is
  read back from disk; then the last turn is sent again as it was, after ``serve`` is
  restarted once more, and after stage 1 alone is killed (the head restarts it);
- ``tiny memory``: ``--prefix-cache-bytes`` of about one block, so the disk tier
  carries the hits of a server that stays up.

Then ``--prefixes`` different prompts of ``--prefix-tokens`` tokens, each sent twice,
with the memory tier sized to hold about one of them: the second pass comes from disk.
Every answer must equal the cache-off run's. Each run has a ``$MLXPIPE_HOME`` of its
own, so that each starts cold on the same texts (under a fresh temporary folder, or
``--home``; the nodes' profiles are shared).
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Tuple

import httpx

from mlxpipe.bench.common import HttpServer, long_text, median, pin_flags, stream_chat
from mlxpipe.bench.soak import stage_pids

SYSTEM = "You are a coding agent. Tools: read_file, edit_file, run_tests. The repository's main file follows.\n"


class Serve:
    """`mlxpipe serve` on its run's ``home``, killed rather than stopped."""

    def __init__(self, path: str, args, home: Path, *extra: str):
        cmd = [sys.executable, "-m", "mlxpipe.server.cli", "serve", "--port", "0", "--model", path,
               "--stages", str(args.stages), "--no-speculate", *pin_flags(args.pin), *extra]
        home.mkdir(parents=True, exist_ok=True)
        if not (home / "profiles").exists():  # what the nodes measured: the same for every run
            (home.parent / "profiles").mkdir(exist_ok=True)
            (home / "profiles").symlink_to(home.parent / "profiles")
        os.environ["MLXPIPE_HOME"] = str(home)  # (the server's processes inherit it)
        self.server = HttpServer("mlxpipe", cmd)
        self.url = self.server.url

    def stages(self) -> List[dict]:
        return httpx.get(f"{self.url}/health", timeout=30).json()["stages"]

    def kill(self) -> None:
        """SIGKILL, then wait for its stage processes, which leave once they see it gone."""
        pids = [p for p in stage_pids(self.server.proc.pid, [s["address"] for s in self.stages()]) if p]
        self.server.proc.kill()
        self.server.proc.wait()
        deadline = time.monotonic() + 60
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)

    def kill_stage(self, i: int) -> None:
        """SIGKILL stage ``i`` alone; returns once the head has restarted it and serves again."""
        before = httpx.get(f"{self.url}/health", timeout=30).json()["recoveries"]
        os.kill(stage_pids(self.server.proc.pid, [s["address"] for s in self.stages()])[i], signal.SIGKILL)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            r = httpx.get(f"{self.url}/health", timeout=30)
            if r.status_code == 200 and r.json()["recoveries"] > before:
                return
            time.sleep(0.5)
        raise RuntimeError("the pipeline did not recover from the stage's kill")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True


async def _ask(http, url: str, messages: List[dict], max_tokens: int) -> dict:
    body = {"model": "default", "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    t0 = time.monotonic()
    times, text, usage = await stream_chat(http, url, body)
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {"ttft": (times[0] if times else time.monotonic()) - t0, "text": text,
            "prompt_tokens": usage.get("prompt_tokens") or 0, "cached_tokens": cached,
            "disk_tokens": (usage.get("cached_tokens_by_tier") or {}).get("disk", 0)}


def _turns(tok, args, tag: str) -> List[List[dict]]:
    """The agent's messages before each turn's answer (answers are filled in as they come)."""
    prefix = SYSTEM + long_text(tok, args.prefix_tokens, f"{tag}-file")
    return [[{"role": "system", "content": prefix}]] + [
        [{"role": "user", "content": f"Tool result {i}:\n{long_text(tok, args.turn_tokens, f'{tag}-{i}')}\n"
                                     f"What should change next?"}] for i in range(args.turns)]


async def _session(http, start, tok, args, tag: str, restart: bool) -> List[dict]:
    """The agent's turns on servers ``start()`` makes: one for all, or a new one per turn."""
    parts, history, out = _turns(tok, args, tag), [], []
    history += parts[0]
    server = None
    for turn in parts[1:]:
        history += turn
        if server is None or restart:
            if server is not None:
                server.kill()
            server = start()
        r = await _ask(http, server.url, history, args.max_tokens)
        history.append({"role": "assistant", "content": r["text"]})
        out.append(r)
    if restart:  # the last turn again, as it was: after serve restarts, after stage 1 alone restarts
        history.pop()
        server.kill()
        server = start()
        out.append(await _ask(http, server.url, history, args.max_tokens))
        server.kill_stage(1)
        out.append(await _ask(http, server.url, history, args.max_tokens))
    server.kill()
    return out


async def _prefixes(http, start, tok, args, tag: str) -> Dict[str, List[dict]]:
    server = start()
    prompts = [[{"role": "system", "content": SYSTEM + long_text(tok, args.prefix_tokens, f"{tag}-p{i}")},
                {"role": "user", "content": "Summarize the file."}] for i in range(args.prefixes)]
    passes = {"first": [], "second": []}
    for name in passes:
        for messages in prompts:
            passes[name].append(await _ask(http, server.url, messages, args.max_tokens))
    server.kill()
    return passes


async def bench_restart(args, path: str, tok) -> dict:
    home = Path(args.home or tempfile.mkdtemp(prefix="mlxpipe-bench-home-"))
    try:
        return await _runs(args, path, tok, home)
    finally:
        if not args.home:
            shutil.rmtree(home, ignore_errors=True)


async def _runs(args, path: str, tok, home: Path) -> dict:
    tag = f"{os.getpid()}-{int(time.time())}"

    def serve(run: str, *extra: str):
        return lambda: Serve(path, args, home / run, *extra)

    async with httpx.AsyncClient(timeout=3600) as http:
        probe = serve("probe", "--prefix-cache-bytes", "0")()  # what a token's keys and values cost a stage
        per_token = max(s.get("kv_bytes_per_token") or 0 for s in probe.stages()) or 1
        probe.kill()
        runs = {} if not args.turns else {  # (--turns 0: the prefixes alone)
            "cache off": await _session(http, serve("off", "--prefix-cache-bytes", "0"), tok, args, tag, False),
            "restarts": await _session(http, serve("restarts"), tok, args, tag, True),
        }
        if args.turns > 1:  # (its first turn is cold: only later ones can hit)
            runs["tiny memory"] = await _session(http, serve("tiny", "--prefix-cache-bytes", f"{per_token * 32}B"),
                                                 tok, args, tag, False)
        one_prefix = f"{int(per_token * args.prefix_tokens * 1.2)}B"
        prefixes = await _prefixes(http, serve("prefixes", "--prefix-cache-bytes", one_prefix), tok, args,
                                   tag) if args.prefixes else {}
    return report(runs, prefixes, args, str(home), one_prefix)


def _cell(r: dict) -> str:
    share = r["cached_tokens"] / r["prompt_tokens"] if r["prompt_tokens"] else 0
    disk = r["disk_tokens"] / r["cached_tokens"] if r["cached_tokens"] else 0
    return f"{r['ttft']:7.2f}s {share:4.0%} ({disk:4.0%} disk)"


def _sessions(runs: Dict[str, List[dict]], args, home: str) -> Tuple[List[str], bool]:
    """The agent's turns, run by run, and whether every answer equals the cache-off run's."""
    base = runs["cache off"]
    lines = [f"agent: a {args.prefix_tokens}-token prefix, {args.turns} turns of +{args.turn_tokens} tokens, "
             f"{args.max_tokens}-token answers; time to first token, the share of the prompt cached (and of that, "
             f"read back from disk); $MLXPIPE_HOME {home}",
             f"{'turn':>5}{'prompt':>8}   " + "".join(f"{name:>27}" for name in runs)]
    for i, r in enumerate(base):
        cells = "".join(f"{_cell(runs[name][i]):>27}" for name in runs)
        lines.append(f"{i + 1:5d}{r['prompt_tokens']:8d}   {cells}")
    cold = base[-1]["ttft"]
    for r, when in zip(runs["restarts"][-2:], ("serve was restarted", "stage 1 alone was restarted")):
        lines.append(f"  the last turn sent again after {when}: {_cell(r)}, x{r['ttft'] / cold:.3f} of its cold "
                     f"time ({cold:.2f}s, the cache off)")
    equal = all(runs[name][i]["text"] == base[i]["text"] for name in runs for i in range(len(base)))
    return lines, equal and all(r["text"] == base[-1]["text"] for r in runs["restarts"][-2:])


def report(runs: Dict[str, List[dict]], prefixes: Dict[str, List[dict]], args, home: str, one_prefix: str) -> dict:
    lines, equal = _sessions(runs, args, home) if runs else ([], True)
    out: dict = {"runs": runs}
    if prefixes:
        first, second = (median([r["ttft"] for r in prefixes[k]]) for k in ("first", "second"))
        second_pass = prefixes["second"]
        disk = sum(r["disk_tokens"] for r in second_pass) / max(sum(r["prompt_tokens"] for r in second_pass), 1)
        equal = equal and all(a["text"] == b["text"] for a, b in zip(prefixes["first"], prefixes["second"]))
        lines.append(f"prefixes: {args.prefixes} different {args.prefix_tokens}-token prompts, each twice, memory tier "
                     f"{one_prefix} (about one of them): median TTFT {first:.2f}s first, {second:.2f}s second "
                     f"(x{second / first:.3f}); second pass {disk:.0%} of its prompts read back from disk")
        out["prefixes"] = prefixes | {"median_first": first, "median_second": second, "ratio": second / first}
    lines.append(f"answers equal {'to the cache-off run' if runs else 'between the passes'}: {'yes' if equal else 'NO'}")
    out["equal"] = equal
    print("\n".join(lines))
    return out
