"""``mlxpipe plan``: the best split of a model over nodes given on the command line, on paper."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import List, Optional, Tuple

from mlxpipe.server import config as tree
from mlxpipe.server.cli.options import table
from mlxpipe.server.cluster.bits import BitsChoice, plan_bits
from mlxpipe.server.cluster.context import STREAMS, at_kv_bits, context_table, plan_context
from mlxpipe.server.cluster.cost import ModelCost, load_model_cost
from mlxpipe.server.cluster.planner import NodeSpec, Plan, Workload, fits, plan
from mlxpipe.server.cluster.sizing import KV_MARGIN
from mlxpipe.server.config import ClusterConfig, PLANNED_CONTEXT
from mlxpipe.shards.params.quant import AUTO_RUNGS, DEFAULT_GROUP_SIZE, QuantSpec
from mlxpipe.shards.params.sizes import expand_list, gb, parse_bandwidth, parse_size

DEFAULT_BANDWIDTH = 800e9      # bytes/s that `mlxpipe plan` assumes without --bandwidth
DEFAULT_FLOPS = 25e12          # flop/s it assumes without --flops (about an M2/M3 Ultra's GPU at 16 bits)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``mlxpipe plan``."""
    p.add_argument("--model", required=True,
                   help="model folder (config.json, and *.safetensors if present) or a config.json file")
    p.add_argument("--nodes", required=True,
                   help="memory budget per node for weights + KV cache, in pipeline order, "
                        "e.g. 144GB,144GB or 3x144GB or studio=384GB,mini=48GB")
    p.add_argument("--bits", default=None,
                   help="quantize to this many bits, or by one of mlx-lm's mixed recipes (mixed_3_6, ...), or "
                        "'auto': per layer the most bits that fit the nodes (default: the folder's own "
                        "quantization, else 16-bit)")
    p.add_argument("--group-size", type=int, default=None,
                   help=f"quantization group size (default: the folder's own, else {DEFAULT_GROUP_SIZE})")
    tree.add_arguments(p, ClusterConfig, only=("context", "concurrency", "kv_bits", "kv_group_size"))
    p.add_argument("--bandwidth", default=None,
                   help="memory bandwidth, one for all nodes or one per node, e.g. 800GB/s "
                        f"(default {DEFAULT_BANDWIDTH / 1e9:.0f}GB/s)")
    p.add_argument("--hop-ms", type=float, default=0.0, help="link time per stage hop in ms (default 0)")
    p.add_argument("--flops", default=None,
                   help="compute for prefill, one for all nodes or one per node, e.g. 25TFLOPS "
                        f"(default {DEFAULT_FLOPS / 1e12:.0f}TFLOPS)")
    p.add_argument("--prompt-ratio", type=float, default=Workload.prompt_ratio,
                   help="prompt tokens per generated token the split is balanced for (default "
                        f"{Workload.prompt_ratio:g}: chat and agents; 0: decode alone)")
    p.add_argument("--prompt-tokens", type=int, default=2048,
                   help="the prompt whose time to first token is predicted (default %(default)s)")
    p.add_argument("--chunk", type=int, default=Workload.chunk_tokens,
                   help=f"prefill tokens per frame, as serve's --chunk-size (default {Workload.chunk_tokens})")
    p.add_argument("--link", action="append", default=None, metavar="RATE,LATENCY",
                   help="a link's throughput and one-way latency, e.g. 40Gbps,50us (Thunderbolt 5) or "
                        "1Gbps,300us: once for every hop, or once per hop between consecutive --nodes; the "
                        "prediction then prices each hop (the head on the first node)")
    p.add_argument("--mtp", action="store_true", help="with the model's multi-token-prediction head on the last "
                   "stage, which drafts with it (where its config declares one: num_nextn_predict_layers)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")


def parse_flops(text: str) -> float:
    """Flop/s from '25TFLOPS', '25T', '2.5e13' (K, M, G, T, P: powers of 1000)."""
    t = text.strip().upper().removesuffix("/S").removesuffix("FLOPS").strip()
    scale = 1000 ** ("KMGTP".index(t[-1]) + 1) if t and t[-1] in "KMGTP" else 1
    try:
        value = float(t[:-1] if scale > 1 else t) * scale
    except ValueError:
        raise ValueError(f"cannot read compute {text!r}: use e.g. 25TFLOPS") from None
    if not value > 0:
        raise ValueError(f"compute {text!r} must be positive")
    return value


def _per_node(given: Optional[str], default: float, parse, count: int, what: str) -> List[float]:
    values = [default] if given is None else [parse(v) for v in expand_list(given)]
    if len(values) == 1:
        values *= count
    if len(values) != count:
        raise ValueError(f"{what} gives {len(values)} values for {count} nodes: give one, or one per node")
    return values


def _nodes_from_args(args) -> Tuple[List[NodeSpec], bool]:
    items = expand_list(args.nodes)
    if not items:
        raise ValueError("--nodes lists no node")
    names, sizes = [], []
    for i, item in enumerate(items):
        name, _, size = item.rpartition("=")
        names.append(name.strip() or f"node{i}")
        sizes.append(parse_size(size))
    bws = _per_node(args.bandwidth, DEFAULT_BANDWIDTH, parse_bandwidth, len(items), "--bandwidth")
    flops = _per_node(args.flops, DEFAULT_FLOPS, parse_flops, len(items), "--flops")
    return ([NodeSpec(n, m, bandwidth_bytes_per_s=b, flops_per_s=f) for n, m, b, f in zip(names, sizes, bws, flops)],
            args.bandwidth is None)


@dataclasses.dataclass
class _Planned:
    """What ``mlxpipe plan`` chose: the cost at the KV bits asked for, its plan, the context."""

    cost: ModelCost           # weights as chosen, KV at --kv-bits
    base: ModelCost           # the same weights, KV at 16 bits (for the context table)
    plan: Plan
    choice: Optional[BitsChoice]
    context: int
    clamped: bool             # the model's own context did not fit: the longest that does
    most: int                 # the model's own context
    cuts: object = None       # where the model can be cut (``shards/models/cuts.py``)
    links: Optional[List[str]] = None  # with --link: the chosen split with every hop priced, in words
    layouts: object = None    # with --link: (the best layout, every layout): stages as tensor-parallel groups


def _weights_cost(args, spec: Optional[QuantSpec] = None) -> ModelCost:
    """The model's cost at 16-bit KV: at ``spec``, or the bits asked for (a recipe, a number, as stored)."""
    if spec is not None:
        return load_model_cost(args.model, quant=spec, mtp=args.mtp)
    bits = None if args.bits is None else args.bits.strip()
    if bits is not None and not bits.isdigit():  # a mixed recipe
        return load_model_cost(args.model, quant=QuantSpec.parse(bits, args.group_size), mtp=args.mtp)
    return load_model_cost(args.model, None if bits is None else int(bits), args.group_size, mtp=args.mtp)


def _cost_and_plan(args, nodes: List[NodeSpec]) -> _Planned:
    """The model's cost at the bits asked for, the context and its plan (``--bits auto``: the
    choice of bits too). Without ``--context``: the model's own, clamped to what fits."""
    kw = dict(concurrency=args.concurrency, hop_seconds=args.hop_ms / 1000,
              workload=Workload(args.prompt_ratio, args.chunk), cuts=args.cuts)
    kv = args.kv_bits
    if args.bits is not None and args.bits.strip() == "auto":
        group = args.group_size or DEFAULT_GROUP_SIZE
        cost_of = lambda spec: at_kv_bits(load_model_cost(args.model, quant=spec, mtp=args.mtp), kv,  # noqa: E731
                                          args.kv_group_size)
        lowest = min((cost_of(QuantSpec(r, group)) for r in AUTO_RUNGS), key=lambda c: c.weight_bytes)
        most = lowest.max_positions or PLANNED_CONTEXT
        context, choice, clamped = plan_context(
            lambda c: plan_bits(cost_of, nodes, group_size=group, context=c, **kw), most,
            lambda c: fits(lowest, nodes, c, args.concurrency), args.context)
        return _Planned(choice.cost, _weights_cost(args, choice.spec), choice.plan, choice, context, clamped, most)
    base = _weights_cost(args)
    cost, most = at_kv_bits(base, kv, args.kv_group_size), base.max_positions or PLANNED_CONTEXT
    context, result, clamped = plan_context(lambda c: plan(cost, nodes, context=c, **kw), most,
                                            lambda c: fits(cost, nodes, c, args.concurrency), args.context)
    return _Planned(cost, base, result, None, context, clamped, most)


def _quant_name(cost: ModelCost) -> str:
    if cost.quant is not None:
        return cost.quant.describe()
    return f"{cost.bits}-bit, group {cost.group_size}" if cost.bits else "16-bit"


def _summary(p: _Planned, args) -> dict:
    cost = p.cost
    kinds = [l.kind for l in cost.layers]
    return {
        "model": cost.name, "model_type": cost.model_type, "num_layers": cost.num_layers,
        "dense_layers": kinds.count("dense"), "moe_layers": kinds.count("moe"),
        "bits": cost.bits, "group_size": cost.group_size if cost.bits or cost.quant else None,
        "quantization": _quant_name(cost), "mean_bits": cost.mean_bits,
        "layer_bits": [cost.quant.layer(i) for i in range(cost.num_layers)] if cost.quant else None,
        "sizes_from": cost.source,
        "params": cost.total_params, "active_params": cost.active_params,
        "weight_bytes": cost.weight_bytes, "read_bytes_per_token": cost.read_bytes,
        "kv_bits": cost.kv_bits, "kv_group_size": cost.kv_group_size, "kv_margin": KV_MARGIN,
        "kv_bytes_per_token": cost.kv_bytes_per_token, "context": p.context, "context_clamped": p.clamped,
        "model_context": p.most, "concurrency": args.concurrency,
    }


def run(args) -> int:
    """``mlxpipe plan``: print the best split (a table, or JSON with --json); 2 when nothing fits."""
    try:
        nodes, assumed = _nodes_from_args(args)
        cuts = model_cuts(args.model)
        args.cuts = None if cuts.all_valid else cuts.valid
        p = _cost_and_plan(args, nodes)
        decode_only = plan(p.cost, nodes, context=p.context, concurrency=args.concurrency,
                           hop_seconds=args.hop_ms / 1000, workload=Workload(0, args.chunk), cuts=args.cuts)
        contexts = context_table(p.base, nodes, p.most, group_size=args.kv_group_size)
        priced = _priced(args, p, nodes)
        p.cuts, p.links = cuts, priced.lines([n.name for n in nodes]) if priced else None
        p.layouts = _layouts(args, p, nodes)
    except ValueError as e:
        if args.json:
            print(json.dumps({"feasible": False, "error": str(e)}, indent=2))
        else:
            print(f"mlxpipe plan: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(_json(args, p, nodes, assumed, decode_only, contexts), indent=2))
        return 0
    _print_plan(args, p, decode_only, contexts)
    return 0


def _json(args, p: _Planned, nodes, assumed: bool, decode_only: Plan, contexts) -> dict:
    result = p.plan
    out = {"feasible": True, **_summary(p, args), "bandwidth_assumed": assumed, "flops_assumed": args.flops is None,
           "nodes": [asdict(n) for n in nodes], **result.to_dict(), "ttft_s": result.ttft(args.prompt_tokens),
           "workload": {"prompt_ratio": args.prompt_ratio, "chunk_tokens": args.chunk,
                        "prompt_tokens": args.prompt_tokens},
           "decode_only": dict(decode_only.to_dict(), ttft_s=decode_only.ttft(args.prompt_tokens)),
           "context_table": [{"kv_bits": r.kv_bits, "kv_bytes_per_token": r.kv_bytes_per_token,
                              "longest_context": {str(n): c for n, c in r.longest.items()}} for r in contexts],
           "cuts": p.cuts.to_dict(), "links": p.links}
    if p.layouts is not None:
        best, choices = p.layouts
        out["layouts"] = [{"widths": list(c.widths), "layout": c.describe(), "chosen": c is best,
                           "tokens_per_s_one_stream": c.one_stream,
                           "tokens_per_s": c.tokens_per_s(args.concurrency), "why_not": c.why_not,
                           "layers": [s.num_layers for s in c.priced.plan.stages] if c.priced else None}
                          for c in choices]
    for st, s in zip(out["stages"], result.stages):
        st["mean_bits"] = p.cost.stage_mean_bits(s.start, s.end)
    if p.choice is not None:
        out["trade"] = p.choice.trade()
    return out


def _print_plan(args, p: _Planned, decode_only: Plan, contexts) -> None:
    cost, result = p.cost, p.plan
    kinds = [l.kind for l in cost.layers]
    quant = _quant_name(cost) if p.choice is None else f"--bits auto: {_quant_name(cost)}"
    print(f"{cost.name}: {cost.num_layers} layers ({kinds.count('dense')} dense, {kinds.count('moe')} MoE), "
          f"{quant}, {cost.total_params / 1e9:.1f}B parameters ({cost.active_params / 1e9:.1f}B per token)")
    print(f"weights {gb(cost.weight_bytes)} (sizes from {cost.source}), {gb(cost.read_bytes)} read per token")
    print(_kv_line(args, p))
    for what, given, value in (("bandwidth", args.bandwidth, f"{DEFAULT_BANDWIDTH / 1e9:.0f} GB/s"),
                               ("compute", args.flops, f"{DEFAULT_FLOPS / 1e12:.0f} TFLOPS")):
        if given is None:
            print(f"{what}: {value} assumed for every node (no --{'bandwidth' if what == 'bandwidth' else 'flops'} "
                  "given)")
    print()
    rows = [["stage", "node", "layers", "#layers", "bits", "weights GB", "KV GB", "ms/token"]]
    for i, s in enumerate(result.stages):
        b = cost.stage_mean_bits(s.start, s.end)
        rows.append([str(i), s.node, f"[{s.start}, {s.end})", str(s.num_layers), _bits_cell(cost, s, b),
                     f"{s.weight_bytes / 1e9:.1f}", f"{s.kv_bytes / 1e9:.2f}", f"{s.seconds * 1e3:.2f}"])
    print(table(rows, right=range(3, 8)))
    if result.unused:
        print(f"left out: {', '.join(result.unused)}")
    print()
    print(f"predicted decode: {result.tokens_per_s_one_stream:.1f} tokens/s for one stream, "
          f"{result.tokens_per_s_pipeline:.1f} tokens/s in all with {len(result.stages)} streams in flight "
          f"(one per stage); bandwidth-bound estimate, an upper bound")
    print("\n".join(_mix_lines(args, result, decode_only)))
    print("\n".join([p.cuts.describe() + ("" if p.cuts.traced else " (assumed: the structure could not be read here)"),
                     *(p.links or [])]))
    if p.layouts is not None:
        from mlxpipe.server.cluster.groupplan import lines

        print("\n".join(lines(*p.layouts, args.concurrency)))
    if p.choice is not None:
        print(f"quality: {p.choice.trade()}")
    print()
    print("\n".join(_context_lines(p, contexts)))


def _kv_line(args, p: _Planned) -> str:
    """What the KV cache is planned for."""
    kv = p.cost
    what = (f"the model's own {p.most} do not fit, so the longest that does" if p.clamped
            else "the model's own" if args.context is None else "--context")
    return (f"KV cache {kv.kv_bytes_per_token / 1e3:.1f} KB per token at {kv.kv_bits}-bit (--kv-bits), planned for "
            f"{p.context} tokens ({what}) x {args.concurrency} stream(s) (--concurrency); each stage keeps "
            f"{KV_MARGIN}x its share free (batched caches pad rows and copy a sequence as it joins a group)")


def _context_lines(p: _Planned, contexts) -> List[str]:
    """The context table: for each KV precision, the longest context 1 and 4 streams may each
    hold, layers placed for it (what --context may ask for)."""
    rows = [["KV bits", "KB/token", *(f"{n} stream{'s' if n > 1 else ''}" for n in STREAMS)]]
    for r in contexts:
        rows.append([str(r.kv_bits), f"{r.kv_bytes_per_token / 1e3:.1f}",
                     *(_tokens_cell(r.longest[n], p.most) for n in STREAMS)])
    return [f"longest context that fits beside these weights, each stream, layers placed for it "
            f"(the model's own: {p.most}; KV groups of {DEFAULT_GROUP_SIZE}):", table(rows, right=range(1, 4))]


def _tokens_cell(tokens: int, most: int) -> str:
    if not tokens:
        return "none"
    return f"{tokens} (model's max)" if tokens >= most else str(tokens)


def _mix_lines(args, chosen: Plan, decode_only: Plan) -> List[str]:
    """The split chosen for the workload beside the one balanced for decode alone."""
    mix = f"{args.prompt_ratio:g} prompt tokens per generated token" if args.prompt_ratio else "decode alone"
    lines = [f"balanced for {mix} (--prompt-ratio); time to first token of a {args.prompt_tokens}-token prompt "
             "alone, compute-bound estimate, a lower bound:"]
    plans = (("this split", chosen), ("decode-only split", decode_only))[:2 if args.prompt_ratio else 1]
    split = {name: " / ".join(str(s.num_layers) for s in p.stages) for name, p in plans}
    width = max(map(len, split.values()))
    for name, p in plans:
        ttft = p.ttft(args.prompt_tokens)
        lines.append(f"  {name + ':':19}layers {split[name]:{width}}  TTFT {ttft:6.2f} s   decode "
                     f"{p.tokens_per_s_one_stream:.1f} tokens/s one stream, {p.tokens_per_s_pipeline:.1f} in all"
                     if ttft is not None else f"  {name}: prefill not costed")
    return lines


def _bits_cell(cost: ModelCost, stage, mean: Optional[float]) -> str:
    """A stage's bits: one rung, or its layers counted by rung, and the mean."""
    if cost.quant is None or mean is None:
        return str(cost.bits or 16)
    rungs = [cost.quant.layer(i) for i in range(stage.start, stage.end)]
    if len(set(rungs)) == 1:
        return rungs[0]
    counts = " + ".join(f"{rungs.count(r)}x{r}" for r in sorted(set(rungs), key=rungs.index))
    return f"{counts} = {mean:.2f}"


def _config(model: str) -> dict:
    """``--model``'s config (a folder or a config.json), with its text part's sizes."""
    p = Path(model)
    config = json.loads((p / "config.json" if p.is_dir() else p).read_text())
    return config | {k: v for k, v in config.get("text_config", {}).items() if k not in config}


def model_cuts(model: str):
    """Where the model of ``--model`` can be cut (``shards/models/cuts.py``)."""
    from mlxpipe.shards.models.cuts import of_config

    config = _config(model)
    return of_config(json.loads((Path(model) / "config.json" if Path(model).is_dir() else Path(model)).read_text()),
                     int(config.get("num_hidden_layers", 0)))


def _priced(args, p: _Planned, nodes: List[NodeSpec]):
    """With --link: the chosen split with every hop priced (bf16 activations), else None."""
    if not args.link:
        return None
    from mlxpipe.server.cluster import linkplan

    hidden = int(_config(args.model).get("hidden_size", 0))
    links = linkplan.Links.in_a_row(hidden * 2, [linkplan.parse_link(x) for x in args.link], len(nodes))
    used = [s.node_index for s in p.plan.stages]
    sub = linkplan.Links(links.row_bytes, tuple(links.head[i] for i in used),
                         {(a, b): links.between(used[a], used[b]) for a in range(len(used))
                          for b in range(a + 1, len(used))})
    return linkplan.evaluate(p.cost, [nodes[i] for i in used], sub, p.plan.ranges, context=p.context,
                             concurrency=args.concurrency, workload=Workload(args.prompt_ratio, args.chunk))


def _layouts(args, p: _Planned, nodes: List[NodeSpec]):
    """With --link: every layout of the nodes as stages of tensor-parallel groups, planned with
    the links priced (``groupplan.py``), and the best; else None."""
    if not args.link:
        return None
    from mlxpipe.server.cluster import groupplan, linkplan
    from mlxpipe.shards.models.tensor_parallel import why_not

    given = Path(args.model)
    raw = json.loads((given / "config.json" if given.is_dir() else given).read_text())
    if p.cost.bits and not raw.get("quantization"):  # split as it will be quantized
        raw = dict(raw, quantization={"bits": p.cost.bits, "group_size": p.cost.group_size})
    hidden = int(_config(args.model).get("hidden_size", 0))
    links = linkplan.Links.in_a_row(hidden * 2, [linkplan.parse_link(x) for x in args.link], len(nodes))
    return groupplan.choose(p.cost, nodes, links, hidden, lambda k: why_not(raw, k), context=p.context,
                            concurrency=args.concurrency, workload=Workload(args.prompt_ratio, args.chunk),
                            cuts=args.cuts)
