"""``mlxpipe bench grammar``: what a grammar costs per token on the last stage.

Runs the whole model in this process (mlx-lm's ``load``) and picks every token
as the last stage does (``SeqSampler`` and ``pick_batch`` with a grammar
``Constraint``), at temperature 1 with a JSON schema, timing the two things
the grammar adds to a token's critical path: the mask (waiting for llguidance's
token mask, computed ahead on a worker thread during the forward pass, and
applying it to the logits) and the accept (the grammar advanced past the
pick), beside the forward pass of the same token for scale, and the mask's own
computing time (off the critical path when it is done ahead). Each run's
output is checked against the schema.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Dict, List

import mlx.core as mx

from mlxpipe.bench.common import median, percentile, progress_bar
from mlxpipe.server.api.structured import response_format_grammar, tokenizer_json
from mlxpipe.server.config import ClusterConfig
from mlxpipe.shards.models.grammar import Constraint, tokenizer_from_json
from mlxpipe.shards.models.store import resolve_model
from mlxpipe.shards.params.sampling import Sampling
from mlxpipe.shards.worker.sampler import SeqSampler, pick_batch

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "email", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 24},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "email": {"type": "string", "maxLength": 40},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4}}}


class TimedConstraint(Constraint):
    """A Constraint that records how long each mask and accept takes."""

    def __init__(self, *args, times: Dict[str, List[float]]):
        super().__init__(*args)
        self.times = times

    def _allowed(self):
        t0 = time.perf_counter()
        out = super()._allowed()
        self.times["compute"].append(time.perf_counter() - t0)
        return out

    def mask(self, logits):
        t0 = time.perf_counter()
        out = super().mask(logits)
        mx.eval(out)
        self.times["mask"].append(time.perf_counter() - t0)
        return out

    def accept(self, tokens):
        t0 = time.perf_counter()
        super().accept(tokens)
        self.times["accept"].append(time.perf_counter() - t0)


def measure(path, runs: int, max_tokens: int) -> dict:
    from mlx_lm import load
    from mlx_lm.models.cache import make_prompt_cache

    model, tok = load(str(path))
    vocab = int(model.args.vocab_size)
    t0 = time.perf_counter()
    ll = tokenizer_from_json(tokenizer_json(tok), vocab, sorted(tok.eos_token_ids))
    tokenizer_s = time.perf_counter() - t0
    grammar = response_format_grammar({"type": "json_schema", "json_schema": {"schema": SCHEMA, "strict": True}})
    prompt = tok.apply_chat_template([{"role": "user", "content": "Describe a person as JSON."}],
                                     add_generation_prompt=True)
    times: Dict[str, List[float]] = {"mask": [], "accept": [], "compute": [], "forward": [], "compile": []}
    valid = tokens = 0
    bar = progress_bar(runs, "grammar runs")
    for run in range(runs):
        t0 = time.perf_counter()
        constraint = TimedConstraint(grammar, ll, vocab, times=times)
        times["compile"].append(time.perf_counter() - t0)
        sampler = SeqSampler(Sampling(temperature=1.0, seed=run), constraint)
        cache = make_prompt_cache(model)
        logits = model(mx.array(prompt)[None], cache=cache)[:, -1, :]
        mx.eval(logits)
        out = []
        for pos in range(max_tokens):
            (token, _, _), = pick_batch([sampler], logits, [len(prompt) + pos])
            out.append(token)
            if sampler.finished or token in tok.eos_token_ids:
                break
            t0 = time.perf_counter()
            logits = model(mx.array([[token]]), cache=cache)[:, -1, :]
            mx.eval(logits)
            times["forward"].append(time.perf_counter() - t0)
        tokens += len(out)
        try:
            valid += _valid(json.loads(tok.decode(out)))
        except json.JSONDecodeError:
            pass
        if bar is not None:
            bar.update()
    if bar is not None:
        bar.close()
    ms = {k: (1e3 * median(v), 1e3 * percentile(v, 95)) for k, v in times.items()}
    return {"model": str(path), "runs": runs, "tokens": tokens, "valid": valid, "tokenizer_s": tokenizer_s,
            "ms": ms}


def _valid(obj) -> bool:
    """The schema's checks, by hand (the bench needs no validator)."""
    props = SCHEMA["properties"]
    return (isinstance(obj, dict) and set(obj) == set(props) and isinstance(obj["name"], str)
            and len(obj["name"]) <= 24 and isinstance(obj["age"], int) and 0 <= obj["age"] <= 150
            and isinstance(obj["email"], str) and len(obj["email"]) <= 40 and isinstance(obj["tags"], list)
            and len(obj["tags"]) <= 4 and all(isinstance(t, str) and len(t) <= 12 for t in obj["tags"]))


async def bench_grammar(args) -> dict:
    r = measure(resolve_model(args.model), args.runs, args.max_tokens)
    ms = r["ms"]
    print(f"{r['model']}: {r['runs']} runs, {r['tokens']} tokens at temperature 1, "
          f"{r['valid']}/{r['runs']} valid against the schema")
    for k in ("mask", "accept", "compute", "forward", "compile"):
        print(f"  {k:8s} median {ms[k][0]:7.3f} ms   p95 {ms[k][1]:7.3f} ms")
    print(f"  tokenizer built once in {r['tokenizer_s']:.2f} s; mask + accept = "
          f"{100 * (ms['mask'][0] + ms['accept'][0]) / ms['forward'][0]:.1f}% of a forward pass (medians)")
    return r


def add_parser(sub: argparse._SubParsersAction) -> None:
    q = sub.add_parser("grammar")
    q.add_argument("--model", default=ClusterConfig.model,
                   help="model folder, HF repo id, or 'default' (the embedded one)")
    q.add_argument("--runs", type=int, default=20, help="constrained generations")
    q.add_argument("--max-tokens", type=int, default=96, help="tokens per answer, at most (default %(default)s)")
    q.add_argument("--json", default=None, help="also write the results as JSON to this file")
    q.set_defaults(measure=bench_grammar)
