"""``mlxpipe bench tp``: a stage split across ranks (tensor parallel) beside the alternatives, in
one run and on the same prompts, one stream and 8 streams through the HTTP API:

- ``mlx-lm``: single-process ``generate`` (one stream), the reference;
- ``mlx_lm.server``: one process (pinned to core 0 with --pin);
- ``pipeline``: ``mlxpipe serve --stages 2`` (each stage a process on a core of its own);
- ``tp``: ``mlxpipe serve --stages 1 --tp 2`` (one stage of 2 ranks, each on a core of its own);
- ``mlx_lm.server 2 ranks``: mlx-lm's own tensor parallel, two processes joined by MLX's ring
  backend (``MLX_RANK``/``MLX_HOSTFILE``, as ``mlx.launch`` would set them, without its relay),
  where the model lets it (mlx-lm's ``shard()`` splits heads evenly only: the default model's
  9 query heads cannot be, and that server fails its first request; the row then says so).

Speculation is off (``--no-speculate``): the bar is the split itself. Servers run one after the
other (an idle one still polls its collective), warmed first; medians over ``--runs``. With
``--wide`` the model is a random-weight llama of 1024 hidden, 16 layers and 16 heads, 4-bit,
built once under $MLXPIPE_HOME/models (on this machine each rank is one core, so a model with
that much compute per layer shows what a pair of Macs would). Timings need a quiet machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List

from mlx_lm.utils import load_tokenizer

from mlxpipe.bench.common import (Baseline, HttpServer, add_common_arguments, chat_prompt, free_port, long_text,
                                  median, pin_flags, pin_to, progress_bar)
from mlxpipe.bench.load import load_round
from mlxpipe.shards.models.store import default_model_dir, mlxpipe_home, resolve_model
from mlxpipe.shards.params.quant import DEFAULT_GROUP_SIZE

SHORT = 8  # tokens a stream, at least, inside the window that every stream decodes in, for a steady aggregate
WIDE = dict(hidden_size=1024, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=16, head_dim=64,
            intermediate_size=4096)


def wide_model() -> Path:
    """The random-weight llama of ``WIDE``'s shape, 4-bit (mlx-lm's default group), made once."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.utils import save_model

    from mlxpipe.bench import tiny

    out = mlxpipe_home() / "models" / "bench-llama-1024x16-4bit"
    if (out / "config.json").exists():
        return out
    model, config = tiny.make_model("llama", extra=WIDE)
    nn.quantize(model, group_size=DEFAULT_GROUP_SIZE, bits=4)
    mx.eval(model.parameters())
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    save_model(tmp, model)
    config = dict(config, quantization={"group_size": DEFAULT_GROUP_SIZE, "bits": 4})
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    for name in tiny.TOKENIZER_FILES:
        (tmp / name).write_bytes((default_model_dir() / name).read_bytes())
    tmp.rename(out)
    return out


class RingServer(HttpServer):
    """``mlx_lm.server`` under ``ranks`` ring ranks: one process per rank (rank r on core r with
    ``pin``), rank 0 serving HTTP."""

    def __init__(self, path: str, ranks: int, pin):
        fd, self.hostfile = tempfile.mkstemp(prefix="mlxpipe-bench-ring-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump([[f"127.0.0.1:{free_port()}"] for _ in range(ranks)], f)
        port = free_port()
        cmd = [sys.executable, "-m", "mlx_lm", "server", "--model", path, "--port", str(port),
               "--log-level", "WARNING"]
        self.others = [subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                        env=dict(os.environ, MLX_RANK=str(r), MLX_HOSTFILE=self.hostfile),
                                        preexec_fn=pin_to(r if pin else None)) for r in range(1, ranks)]
        try:
            super().__init__(f"mlx_lm.server {ranks} ranks", cmd, cpu=0 if pin else None, port=port,
                             env=dict(os.environ, MLX_RANK="0", MLX_HOSTFILE=self.hostfile))
        except BaseException:  # rank 0 never served (the model cannot be split, say): the others go too
            self.proc = getattr(self, "proc", None)
            self.close()
            raise

    def close(self) -> None:
        super().close()  # (no process: nothing)
        for proc in self.others:
            proc.kill()
            proc.wait()
        if os.path.exists(self.hostfile):
            os.unlink(self.hostfile)


def _servers(args, path: str) -> List[tuple]:
    """(name, how to start it) of every server measured, in order."""
    ours = [sys.executable, "-m", "mlxpipe.server.cli", "serve", "--port", "0", "--model", path, "--no-speculate",
            "--max-tokens", str(args.max_tokens), *pin_flags(args.pin)]
    return [("mlx_lm.server", lambda: HttpServer.mlx_lm(path, args.pin)),
            ("pipeline 2 stages", lambda: HttpServer("pipeline 2 stages", ours + ["--stages", "2"])),
            ("tp 2 ranks", lambda: HttpServer("tp 2 ranks", ours + ["--stages", "1", "--tp", "2"])),
            ("mlx_lm.server 2 ranks", lambda: RingServer(path, 2, args.pin))]


async def _measure_server(start, name: str, path: str, tok, args, levels, bar) -> Dict[int, dict]:
    """One server's rounds at each level (medians over the runs), or why it could not run."""
    model = "default" if name.startswith(("pipeline", "tp")) else path
    eos = sorted(tok.eos_token_ids)
    try:
        server = start()
    except RuntimeError as err:
        return {c: {"error": str(err)} for c in levels}
    try:
        await load_round(server, model, [long_text(tok, args.prompt_tokens, "warm")], 4, eos, False)
        rounds: Dict[int, list] = {c: [] for c in levels}
        for r in range(args.runs):
            for c in levels:
                prompts = [long_text(tok, args.prompt_tokens, f"{r}-{c}-{i}") for i in range(c)]
                rounds[c].append(await load_round(server, model, prompts, args.max_tokens, eos, False))
                if bar:
                    bar.update()
    except Exception as err:  # noqa: BLE001 - mlx-lm's tensor parallel refusing uneven heads, say
        return {c: {"error": f"{type(err).__name__}: {str(err)[:200]}"} for c in levels}
    finally:
        server.close()
    return {c: {"stream_tps": median([median(x.stream_tps) for x in rs]),
                "aggregate_tps": median([x.aggregate_tps for x in rs]),
                "window_tokens": min(x.window_tokens for x in rs)} for c, rs in rounds.items()}


async def bench_tp(args) -> dict:
    path = str(wide_model() if args.wide else resolve_model(args.model))
    tok = load_tokenizer(path)
    levels = [int(x) for x in args.concurrency.split(",")]
    servers = _servers(args, path)
    bar = progress_bar(args.runs * (len(levels) * len(servers) + 1), "tp")
    baseline = Baseline(path, 0 if args.pin else None)
    try:
        single = []
        for r in range(args.runs):
            single.append(baseline.run(chat_prompt(tok, long_text(tok, args.prompt_tokens, f"s{r}")),
                                       args.max_tokens).decode_tps)
            if bar:
                bar.update()
    finally:
        baseline.close()
    results = {"mlx-lm": {1: {"stream_tps": median(single), "aggregate_tps": median(single)}}}
    for name, start in servers:
        results[name] = await _measure_server(start, name, path, tok, args, levels, bar)
    if bar:
        bar.close()
    print("\n".join(_lines(args, path, levels, results)))
    return {"model": path, "levels": levels, "runs": args.runs, "max_tokens": args.max_tokens,
            "prompt_tokens": args.prompt_tokens, "results": {k: {str(c): v for c, v in r.items()}
                                                               for k, r in results.items()}}


def _lines(args, path: str, levels: List[int], results: dict) -> List[str]:
    lines = [f"{Path(path).name}: {args.prompt_tokens}-token prompts, {args.max_tokens} tokens each, greedy, "
             f"speculation off, {args.runs} runs (medians); decode tokens/s",
             f"{'':24}" + "".join(f"{f'{c} stream' + ('s' if c > 1 else ''):>22}" for c in levels)]
    for name, by in results.items():
        cells = []
        for c in levels:
            r = by.get(c)
            cells.append(f"{'-':>22}" if r is None else f"{'failed':>22}" if "error" in r else
                         f"{r['aggregate_tps']:>13.2f} in all" if c > 1 else f"{r['aggregate_tps']:>22.2f}")
        lines.append(f"{name:24}" + "".join(cells))
    for name, by in results.items():
        for c, r in by.items():
            if "error" in r:
                lines.append(f"{name} ({c} stream{'s' if c > 1 else ''}): {r['error']}")
            elif c > 1 and r.get("window_tokens", SHORT * c) < SHORT * c:
                lines.append(f"{name} ({c} streams): only {r['window_tokens']} tokens came while all {c} decoded "
                             "(the first finished soon after the last started): its aggregate is rough; a larger "
                             "--max-tokens widens the window")
    lines += _bar(results, levels)
    return lines


def _bar(results: dict, levels: List[int]) -> List[str]:
    """The issue's bar: one stream through the 2-rank stage at least 1.4x one mlx_lm.server and at
    least mlx_lm.server's 2 ranks; the most streams at least mlx_lm.server's 2 ranks in all."""
    def tps(name, c):
        r = results.get(name, {}).get(c) or {}
        return r.get("aggregate_tps")

    out = []
    ours, one, two = tps("tp 2 ranks", 1), tps("mlx_lm.server", 1), tps("mlx_lm.server 2 ranks", 1)
    if ours and one:
        out.append(f"one stream, tp 2 ranks / mlx_lm.server: {ours / one:.2f}x (bar 1.4x)")
    if ours and two:
        out.append(f"one stream, tp 2 ranks / mlx_lm.server 2 ranks: {ours / two:.2f}x (bar 1.0x)")
    most = max(levels)
    ours, two = tps("tp 2 ranks", most), tps("mlx_lm.server 2 ranks", most)
    if most > 1 and ours and two:
        out.append(f"{most} streams in all, tp 2 ranks / mlx_lm.server 2 ranks: {ours / two:.2f}x (bar 1.0x)")
    return out


def add_parser(sub: argparse._SubParsersAction) -> None:
    q = add_common_arguments(sub.add_parser("tp"))
    q.add_argument("--wide", action="store_true",
                   help="a random-weight llama of 1024 hidden, 16 layers, 16 heads, 4-bit (built once) instead of "
                        "--model")
    q.add_argument("--concurrency", default="1,8", help="streams at once, each level (default %(default)s)")
    q.add_argument("--prompt-tokens", type=int, default=64, help="tokens per prompt (default %(default)s)")
    q.add_argument("--max-tokens", type=int, default=48, help="tokens per answer (default %(default)s)")
    q.set_defaults(measure=bench_tp)
