"""``mlxpipe bench stream``: one stream, mlx-lm ``generate_step`` in its own process vs the
pipeline at 1, 2, 3 stages, decode tokens/s.

With ``--speculative``: one stream on a repetition-heavy prompt (return a
JSON object unchanged, as tools and agents ask) and on a plain chat prompt, with speculation off and
on, and with a draft model the head runs (``--draft-model``), beside plain
mlx-lm and mlx-lm's own speculative generation with the same draft model (by
default the first ``--draft-layers`` layers of the same model, so that it
shares the tokenizer); greedy tokens are checked equal to plain mlx-lm's.
"""

from __future__ import annotations

import argparse
import json
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Dict, List

import mlx.core as mx

from mlxpipe.bench.common import (DEFAULT_PROMPT, Baseline, RunResult, add_common_arguments, chat_prompt, median,
                                  pipeline_run, progress_bar)
from mlxpipe.server.cluster.assembly import Cluster
from mlxpipe.server.config import ClusterConfig
from mlxpipe.shards.models.store import mlxpipe_home, resolve_model
from mlxpipe.shards.worker.node_options import add_launch_ahead

RECORD = ('{"name": "Ada Lovelace", "born": 1815, "city": "London", "field": "mathematics", "known_for": '
          '["Analytical Engine", "first algorithm", "poetical science"], "languages": ["English", "French"], '
          '"parents": {"father": "Lord Byron", "mother": "Anne Isabella Milbanke"}, "married": true, '
          '"children": 3, "died": 1852}')
REPEAT_PROMPT = f"Return this JSON object unchanged: {RECORD}"


async def bench_stream(args) -> dict:
    path = str(resolve_model(args.model))
    counts = [int(x) for x in args.stages.split(",")]
    clusters = {}
    baseline = Baseline(path, 0 if args.pin else None)
    try:
        for n in counts:
            clusters[n] = await Cluster(ClusterConfig(model=path, stages=n, pin=args.pin,
                                                      launch_ahead=args.launch_ahead)).start()
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


def truncated_model(path: Path, layers: int) -> Path:
    """The model's first ``layers`` layers with its own embedding, final norm and
    head: a small draft model that shares its tokenizer (made once, kept)."""
    out = mlxpipe_home() / "models" / f"{path.name}-first{layers}"
    if (out / "config.json").exists():
        return out
    config = json.loads((path / "config.json").read_text())
    config["num_hidden_layers"] = layers
    tensors = {}
    for f in sorted(path.glob("*.safetensors")):
        for name, arr in mx.load(str(f)).items():
            parts = name.split(".")
            if "layers" in parts and int(parts[parts.index("layers") + 1]) >= layers:
                continue
            tensors[name] = arr
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(tmp / "model.safetensors"), tensors)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    for f in path.iterdir():
        if f.name.startswith("tokenizer") or f.name in ("special_tokens_map.json", "generation_config.json"):
            shutil.copy(f, tmp / f.name)
    tmp.rename(out)
    return out


async def bench_speculative(args) -> dict:
    path = resolve_model(args.model)
    n = int(args.stages.split(",")[-1])
    if args.draft_model:
        draft, label = str(resolve_model(args.draft_model)), Path(args.draft_model).name
    else:
        draft, label = str(truncated_model(path, args.draft_layers)), f"{args.draft_layers}-layer draft"
    baseline = Baseline(str(path), 0 if args.pin else None)
    clusters = {}
    try:
        for key, spec, draft_model in (("plain", False, None), ("lookup", True, None), ("draft", True, draft)):
            clusters[key] = await Cluster(ClusterConfig(model=str(path), stages=n, pin=args.pin, speculate=spec,
                                                        draft_model=draft_model,
                                                        launch_ahead=args.launch_ahead)).start()
        tok = clusters["plain"].tokenizer
        prompts = {"repeat JSON": chat_prompt(tok, REPEAT_PROMPT), "chat": chat_prompt(tok, args.prompt)}
        names = ["mlx-lm", f"mlx-lm speculative ({label})", f"{n} stages",
                 f"{n} stages, speculative", f"{n} stages, draft model ({label})",
                 f"{n} stages, lookup then draft model"]
        series = {p: {name: [] for name in names} for p in prompts}
        accepted = {p: {name: [] for name in names[4:]} for p in prompts}  # (accepted, judged) per run
        bar = progress_bar(args.runs * len(prompts) * len(names), "speculative")
        for _ in range(args.runs):
            for p, prompt in prompts.items():
                runs = series[p]
                runs[names[0]].append(baseline.run(prompt, args.max_tokens))
                runs[names[1]].append(baseline.run(prompt, args.max_tokens, draft=draft,
                                                   num_draft_tokens=args.num_draft_tokens))
                runs[names[2]].append(await pipeline_run(clusters["plain"], prompt, args.max_tokens))
                runs[names[3]].append(await pipeline_run(clusters["lookup"], prompt, args.max_tokens))
                for name, source in zip(names[4:], ("draft_model", "auto")):
                    before = clusters["draft"].engine.speculation()
                    runs[name].append(await pipeline_run(clusters["draft"], prompt, args.max_tokens, source))
                    after = clusters["draft"].engine.speculation()
                    accepted[p][name].append((after["accepted_tokens"] - before["accepted_tokens"],
                                              after["drafted_tokens"] - before["drafted_tokens"]))
                if bar:
                    bar.update(len(names))
        if bar:
            bar.close()
    finally:
        baseline.close()
        for c in clusters.values():
            await c.stop()
    lines = [f"one stream, {args.max_tokens} tokens, greedy, {args.runs} runs each; decode tokens/s (medians)"]
    out = {}
    for p, runs in series.items():
        reference = runs[names[0]][0].tokens
        base = median([r.decode_tps for r in runs[names[0]]])
        lines.append(f"{p} ({runs[names[0]][0].prompt_tokens}-token prompt):")
        for name, rs in runs.items():
            tps = median([r.decode_tps for r in rs])
            same = all(r.tokens == reference for r in rs)
            judged = accepted[p].get(name)
            rate = (f", {sum(a for a, _ in judged)}/{sum(j for _, j in judged)} drafts accepted"
                    if judged else "")
            lines.append(f"  {name:44}{tps:8.2f} tok/s {tps / base:7.3f}x   tokens "
                         f"{'identical to mlx-lm' if same else 'DIFFER from mlx-lm'}{rate}")
        out[p] = {name: [asdict(r) for r in rs] for name, rs in runs.items()}
    print("\n".join(lines))
    return out


async def measure(args) -> dict:
    return await (bench_speculative(args) if args.speculative else bench_stream(args))


def add_parser(sub: argparse._SubParsersAction) -> None:
    q = add_common_arguments(sub.add_parser("stream"))
    q.add_argument("--stages", default="1,2,3", help="stage counts to measure (--speculative: the last one)")
    q.add_argument("--max-tokens", type=int, default=64, help="tokens per stream (default %(default)s)")
    q.add_argument("--prompt", default=DEFAULT_PROMPT, help="the prompt (a user message)")
    add_launch_ahead(q, "the stages': ")
    q.add_argument("--speculative", action="store_true",
                   help="a repetition-heavy and a chat prompt, speculation off and on, beside mlx-lm's own")
    q.add_argument("--draft-layers", type=int, default=4,
                   help="without --draft-model: the draft is the model's first this many layers (--speculative)")
    q.add_argument("--draft-model", default=None,
                   help="the draft model for mlx-lm's speculative generation and the pipeline's (--speculative)")
    q.add_argument("--num-draft-tokens", type=int, default=3, help="mlx-lm's draft tokens per step (--speculative)")
    q.set_defaults(measure=measure)
