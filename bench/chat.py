"""``mlxpipe bench chat``: what chat UIs and coding agents send, beside ``mlx_lm.server``.

Both resend long, mostly identical prompts: mlxpipe reuses them through the
prefix cache that spans its stages, ``mlx_lm.server`` through its LRU prompt
cache. Two patterns, both servers in the same run, runs round-robin:

- ``conversation``: one client, ``--turns`` turns; each user turn adds a
  passage of ``--turn-tokens`` tokens and a question, each answer
  ``--max-tokens`` tokens, so the history grows past a thousand tokens. Time to
  first token (TTFT) per turn, and the share of the prompt served from cache.
- ``agent``: a fixed prefix of ``--prefix-tokens`` tokens (a system prompt and a
  file, as coding agents send) and a short varying tail: one cold request, one
  warm one, then ``--clients`` concurrent clients with distinct tails.

``--restart`` measures mlxpipe alone, across restarts: the prefix cache's disk tier
(``chat_restart.py``).

Every run uses texts of its own, so each starts cold; greedy decoding.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from typing import Dict, List

import httpx
from mlx_lm.utils import load_tokenizer

from mlxpipe.bench.common import (HttpServer, add_common_arguments, long_text, median, percentile,
                                  pin_flags, progress_bar, stream_chat)
from mlxpipe.server.config import ClusterConfig
from mlxpipe.shards.models.store import resolve_model

QUESTION = "Summarize the passage above in one sentence."


async def ask(http: httpx.AsyncClient, server: HttpServer, model: str, messages: List[dict],
              max_tokens: int) -> dict:
    """One streamed chat completion: its text, TTFT and usage (cached tokens included)."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0}
    t0 = time.monotonic()
    times, text, usage = await stream_chat(http, server.url, body, server.name)
    prompt = usage.get("prompt_tokens") or 0
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return {"ttft": (times[0] if times else time.monotonic()) - t0, "text": text,
            "prompt_tokens": prompt, "cached_tokens": cached}


async def conversation(http, server: HttpServer, model: str, tok, args, tag: str) -> List[dict]:
    messages = [{"role": "system", "content": "You are a concise reading assistant."}]
    turns = []
    for i in range(args.turns):
        passage = long_text(tok, args.turn_tokens, f"{tag}-{i}")
        messages.append({"role": "user", "content": f"{passage}\n\n{QUESTION}"})
        r = await ask(http, server, model, messages, args.max_tokens)
        messages.append({"role": "assistant", "content": r["text"]})
        turns.append(r)
    return turns


async def agent(http, server: HttpServer, model: str, tok, args, tag: str) -> Dict[str, object]:
    system = "You are a coding agent. Tools: read_file, edit_file, run_tests. The repository file follows.\n"
    prefix = system + long_text(tok, args.prefix_tokens, f"{tag}-file")

    def messages(task: str) -> List[dict]:
        return [{"role": "system", "content": prefix}, {"role": "user", "content": task}]

    cold = await ask(http, server, model, messages("Task 0: list the functions in the file."), args.max_tokens)
    warm = await ask(http, server, model, messages("Task 1: find the bug in the file."), args.max_tokens)
    crowd = await asyncio.gather(*(ask(http, server, model, messages(f"Task {2 + c}: explain part {c} of the file."),
                                       args.max_tokens) for c in range(args.clients)))
    return {"cold": cold, "warm": warm, "clients": list(crowd)}


async def bench_chat(args) -> dict:
    path = str(resolve_model(args.model))
    tok = load_tokenizer(path)
    if args.restart:
        from mlxpipe.bench.chat_restart import bench_restart

        return await bench_restart(args, path, tok)
    servers: List[HttpServer] = []
    try:
        cmd = [sys.executable, "-m", "mlxpipe.server.cli", "serve", "--port", "0", "--model", path,
               "--stages", str(args.stages)]
        cmd += pin_flags(args.pin)
        servers.append(HttpServer("mlxpipe", cmd))
        servers.append(HttpServer.mlx_lm(path, args.pin))
        models = {"mlxpipe": "default", "mlx_lm.server": path}
        results: Dict[str, Dict[str, list]] = {s.name: {"conversation": [], "agent": []} for s in servers}
        patterns = [p for p in ("conversation", "agent") if args.pattern in (p, "both")]
        bar = progress_bar(args.runs * len(servers) * len(patterns), "chat")
        async with httpx.AsyncClient(timeout=3600, limits=httpx.Limits(max_connections=args.clients + 4)) as http:
            for r in range(args.runs):
                for pattern in patterns:
                    for server in servers:
                        fn = conversation if pattern == "conversation" else agent
                        results[server.name][pattern].append(
                            await fn(http, server, models[server.name], tok, args, f"{server.name}-{r}"))
                        if bar:
                            bar.update()
        if bar:
            bar.close()
    finally:
        for s in servers:
            s.close()
    return report(results, args)


def _share(r: dict) -> float:
    return r["cached_tokens"] / r["prompt_tokens"] if r["prompt_tokens"] else 0.0


def report(results: Dict[str, Dict[str, list]], args) -> dict:
    out: dict = {"runs": results}
    lines = []
    if results["mlxpipe"]["conversation"]:
        lines.append(f"conversation: {args.turns} turns of {args.turn_tokens}-token passages, "
                     f"{args.max_tokens}-token answers, {args.runs} runs; medians")
        lines.append(f"{'turn':>4}{'prompt':>8}   {'mlxpipe TTFT':>13}{'cached':>8}   "
                     f"{'mlx_lm.server TTFT':>19}{'cached':>8}   {'ratio':>6}")
        table = []
        for i in range(args.turns):
            row = {"turn": i + 1}
            for name in ("mlxpipe", "mlx_lm.server"):
                turns = [run[i] for run in results[name]["conversation"]]
                row[name] = {"ttft": median([t["ttft"] for t in turns]), "cached_share": median(map(_share, turns)),
                             "prompt_tokens": median([t["prompt_tokens"] for t in turns])}
            row["ratio"] = row["mlxpipe"]["ttft"] / row["mlx_lm.server"]["ttft"]
            table.append(row)
            a, b = row["mlxpipe"], row["mlx_lm.server"]
            lines.append(f"{i + 1:4d}{a['prompt_tokens']:8.0f}   {a['ttft']:12.2f}s{a['cached_share']:8.0%}   "
                         f"{b['ttft']:18.2f}s{b['cached_share']:8.0%}   {row['ratio']:6.2f}")
        out["conversation"] = table
    if results["mlxpipe"]["agent"]:
        lines.append(f"agent: a {args.prefix_tokens}-token prefix + short tails; cold, warm, then "
                     f"{args.clients} concurrent clients; {args.runs} runs; medians")
        summary = {}
        for name in ("mlxpipe", "mlx_lm.server"):
            runs = results[name]["agent"]
            crowd = [c["ttft"] for run in runs for c in run["clients"]]
            summary[name] = {
                "cold_ttft": median([run["cold"]["ttft"] for run in runs]),
                "warm_ttft": median([run["warm"]["ttft"] for run in runs]),
                "warm_cached_share": median([_share(run["warm"]) for run in runs]),
                "clients_ttft_p50": percentile(crowd, 0.5), "clients_ttft_p95": percentile(crowd, 0.95),
                "clients_cached_share": median([_share(c) for run in runs for c in run["clients"]]),
            }
            s = summary[name]
            lines.append(f"  {name:14} cold {s['cold_ttft']:7.2f}s  warm {s['warm_ttft']:6.2f}s "
                         f"(x{s['warm_ttft'] / s['cold_ttft']:.3f} of cold, {s['warm_cached_share']:.0%} cached)  "
                         f"{args.clients} clients TTFT p50 {s['clients_ttft_p50']:.2f}s p95 "
                         f"{s['clients_ttft_p95']:.2f}s ({s['clients_cached_share']:.0%} cached)")
        ratio = summary["mlxpipe"]["warm_ttft"] / summary["mlx_lm.server"]["warm_ttft"]
        lines.append(f"  warm TTFT, mlxpipe / mlx_lm.server: {ratio:.2f}")
        out["agent"] = summary | {"warm_ratio_vs_mlx_lm_server": ratio}
    print("\n".join(lines))
    return out


def add_parser(sub: argparse._SubParsersAction) -> None:
    q = add_common_arguments(sub.add_parser("chat"))
    q.add_argument("--stages", type=int, default=ClusterConfig.stages,
                   help="local stage processes (default %(default)s)")
    q.add_argument("--pattern", choices=("conversation", "agent", "both"), default="both",
                   help="a chat that grows turn by turn, agents resending one long prefix, or both (default)")
    q.add_argument("--turns", type=int, default=6, help="turns of the conversation (default %(default)s)")
    q.add_argument("--turn-tokens", type=int, default=160, help="tokens of the passage each user turn adds")
    q.add_argument("--prefix-tokens", type=int, default=1100, help="tokens of the agent's fixed prefix")
    q.add_argument("--clients", type=int, default=8, help="concurrent agent clients after the warm request")
    q.add_argument("--max-tokens", type=int, default=24, help="tokens per answer")
    q.add_argument("--restart", action="store_true",
                   help="an agent's session across restarts instead: serve killed and started again before every "
                        "turn, one stage killed, a tiny memory tier, beside the prefix cache off (the disk tier)")
    q.add_argument("--prefixes", type=int, default=10, help="with --restart: different --prefix-tokens prompts, each "
                   "sent twice, with memory for about one of them (0: skip)")
    q.add_argument("--home", default=None, help="with --restart: the $MLXPIPE_HOME of the servers (default: a fresh "
                   "temporary one)")
    q.set_defaults(measure=bench_chat)
