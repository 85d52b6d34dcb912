"""``mlxpipe bench embeddings``: embeddings per second through ``mlxpipe serve
--embedding-model`` (``/v1/embeddings`` over HTTP, several clients at once) beside
the model's own library in one process (mlx-embeddings, or mlx-lm for the models it
loads), on the same inputs in batches of the same size; the vectors checked equal."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from typing import List

import httpx
import numpy as np

from mlxpipe.bench.common import HttpServer, median, pin_flags

WORDS = ("the pipeline cuts a model by layer and every stage streams its activations to the next while the head "
         "keeps each sequence's tokens prompts are chunked decode steps are batched and a cache keeps the prefixes "
         "that agents resend on every turn").split()


def inputs(n: int, words: int) -> List[str]:
    """``n`` different texts of ``words`` words each."""
    return [" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(words)) + f" ({i})" for i in range(n)]


def library_run(name: str, texts: List[str], batch: int) -> tuple:
    """The model in this process, by its own library (as the server loads it): (vectors, seconds)."""
    from mlxpipe.server.cluster.embedding_model import load_embedding_model

    model = load_embedding_model(name)
    try:
        ids = model.tokenize(texts)
        started = time.perf_counter()
        out = [model._pool.submit(model._embed, ids[i:i + batch]).result() for i in range(0, len(ids), batch)]
        return np.concatenate(out), time.perf_counter() - started
    finally:
        model.close()


async def served_run(url: str, texts: List[str], batch: int, clients: int) -> tuple:
    """``texts`` through ``/v1/embeddings``, ``batch`` a request, ``clients`` requests at once."""
    chunks = [texts[i:i + batch] for i in range(0, len(texts), batch)]
    out: List = [None] * len(chunks)
    todo = iter(range(len(chunks)))

    async def client(http):
        for i in todo:
            r = await http.post(f"{url}/v1/embeddings", json={"model": "bench", "input": chunks[i]})
            r.raise_for_status()
            out[i] = [d["embedding"] for d in r.json()["data"]]

    async with httpx.AsyncClient(timeout=600) as http:
        started = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(clients)))
        seconds = time.perf_counter() - started
    return np.array([v for chunk in out for v in chunk], dtype=np.float32), seconds


async def bench_embeddings(args) -> dict:
    texts = inputs(args.inputs, args.words)
    runs = {"library, one process": [], f"mlxpipe serve, {args.clients} clients": []}
    server = HttpServer("mlxpipe", [sys.executable, "-m", "mlxpipe.server.cli", "serve", "--port", "0",
                                    "--stages", "1", "--embedding-model", args.embedding_model] + pin_flags(args.pin))
    try:
        await served_run(server.url, texts[: args.batch], args.batch, 1)  # warm
        worst = 0.0
        for _ in range(args.runs):
            want, seconds = await asyncio.to_thread(library_run, args.embedding_model, texts, args.batch)
            runs["library, one process"].append(len(texts) / seconds)
            got, seconds = await served_run(server.url, texts, args.batch, args.clients)
            runs[f"mlxpipe serve, {args.clients} clients"].append(len(texts) / seconds)
            worst = max(worst, float(np.abs(got - want).max()))
    finally:
        server.close()
    base = median(runs["library, one process"])
    lines = [f"{args.inputs} inputs of {args.words} words, {args.batch} a batch (request), {args.runs} runs; "
             f"embedding model {args.embedding_model}; embeddings/s (medians)"]
    for name, rates in runs.items():
        lines.append(f"  {name:34}{median(rates):9.1f} /s {median(rates) / base:7.3f}x")
    lines.append(f"  largest difference between the two's vectors: {worst:.2e}")
    print("\n".join(lines))
    return {"runs": runs, "max_abs_diff": worst, "lines": lines}


def add_parser(sub: argparse._SubParsersAction) -> None:
    q = sub.add_parser("embeddings")
    q.add_argument("--embedding-model", default="default",
                   help="the embedding model (default: all-MiniLM-L6-v2), as serve's --embedding-model takes it")
    q.add_argument("--inputs", type=int, default=512, help="texts embedded per run (default %(default)s)")
    q.add_argument("--words", type=int, default=40, help="words per text (default %(default)s)")
    q.add_argument("--batch", type=int, default=32, help="texts per request and per library call (default %(default)s)")
    q.add_argument("--clients", type=int, default=4, help="requests to the server at once (default %(default)s)")
    q.add_argument("--runs", type=int, default=3, help="runs; medians are reported")
    q.add_argument("--pin", action=argparse.BooleanOptionalAction, default=None, help="as the other modes")
    q.add_argument("--json", default=None, help="also write the results as JSON to this file")
    q.set_defaults(measure=bench_embeddings)
