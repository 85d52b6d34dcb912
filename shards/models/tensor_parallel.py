"""Tensor parallel inside a stage: rank r of a group of k holds a slice of every block of
the stage's range, and the ranks all-reduce inside each block with MLX's own collective
(``mx.distributed.all_sum``, over the backend the group joined: ``shards/worker/group.py``).
Megatron's cut, for any mlx-lm model whose blocks it recognizes:

- attention by heads: each rank a contiguous run of query heads, as even as heads allow
  (9 over 2 ranks: 5 and 4), with the KV heads they read. A KV head whose query heads
  straddle the cut is held by both ranks; the rank's query projection then gains zero
  heads before and after (``PadHeads``), so that the model's own grouped attention maps
  each query head to its KV head, and the output projection drops them again. The output
  projection is split by the same columns and summed over the ranks (``SumOut``).
  DeepSeek's latent attention (MLA) is split by heads the same way (its latent KV is
  every head's, so each rank keeps all of it).
- MLP by columns: the input projections (gate, up) by rows, the output projection (down)
  by columns, one all-reduce.
- mixture of experts: each expert's intermediate columns, as mlx-lm's DeepSeek-V3
  ``shard()`` does, where the quantization groups give every rank some; else the experts
  across the ranks (where the router hands back indices and scores, as DeepSeek's does),
  the others' scores zeroed. One all-reduce for the whole layer (``SumModule``).

What a rank then holds, and how a projection is sliced (on quantization-group boundaries
only), is ``sharded.py``'s. What cannot be split (state-space and linear-attention layers,
fused projections it does not know, a norm across all heads, a cut inside a quantization
group) is ``Unsplittable``, named in one line; ``why_not`` says so of a config, for the
planner, without weights.

Embedding, norms, routers and the output head are not split: every rank of a first stage
embeds; only the leader of a last stage runs the head (``SlicedModel.drop_head``).
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence, Tuple

import mlx.core as mx
import mlx.nn as nn

from mlxpipe.shards.models.sharded import (LocalExperts, Nothing, PadHeads, Part, SumModule, SumOut, Sums, Taped,
                                           Unsplittable, in_features, out_features, runs, take_cols, take_experts,
                                           take_row_runs, take_rows, unit, zero_bias_off_leader)

__all__ = ["Part", "Sums", "Taped", "Unsplittable", "runs", "shard_blocks", "why_not"]

HEAD_NAMES = ("n_heads", "num_heads", "num_attention_heads", "n_head")
KV_NAMES = ("n_kv_heads", "num_key_value_heads", "num_kv_heads", "n_kv_head")
# (input projections, output projection) of the MLPs it knows, by their names in mlx-lm's models.
MLP_NAMES = ((("gate_proj", "up_proj"), "down_proj"), (("w1", "w3"), "w2"), (("fc1",), "fc2"),
             (("c_fc",), "c_proj"), (("gate_up_proj",), "down_proj"))
FUSED = ("gate_up_proj",)  # input projections whose rows are [gate | up]: each half cut alike
ATTN_OUT = ("o_proj", "dense", "out_proj")  # an attention's output projection, by its names in mlx-lm's models
NORM_TYPES = (nn.RMSNorm, nn.LayerNorm)


# -- recognizing and splitting a block's layers ---------------------------------------------------


def _has_weights(module: nn.Module) -> bool:
    return any(isinstance(m, nn.Module) and "weight" in m and getattr(m["weight"], "ndim", 0) >= 2
               for _, m in module.named_modules())


def _per_head(attn: nn.Module, n: int, a: int, b: int, pads: Tuple[int, int] = (0, 0)) -> None:
    """Arrays of the attention module itself with one entry per query head (gpt-oss's sinks):
    this rank's heads, and zeros in the pad slots."""
    for name, arr in list(attn.items()):
        if isinstance(arr, mx.array) and arr.ndim >= 1 and arr.shape[0] == n:
            z = [mx.zeros((p, *arr.shape[1:]), dtype=arr.dtype) for p in pads]
            attn[name] = mx.contiguous(mx.concatenate([z[0], arr[a:b], z[1]]))


def _head_counts(attn: nn.Module, part: Part, what: str) -> Tuple[str, Optional[str], int, int]:
    """The attributes its code reshapes by, and its query and KV heads (``Unsplittable``: unknown, or too few)."""
    hname = next((n for n in HEAD_NAMES if isinstance(getattr(attn, n, None), int)), None)
    kname = next((n for n in KV_NAMES if isinstance(getattr(attn, n, None), int)), None)
    if hname is None:
        raise Unsplittable(f"{what}: cannot tell how many heads it reshapes its queries to")
    nq = getattr(attn, hname)
    nkv = getattr(attn, kname) if kname else nq
    if nq < part.size or nq % nkv:
        raise Unsplittable(f"{what}: {nq} query heads over {nkv} KV heads cannot go to {part.size} ranks")
    return hname, kname, nq, nkv


def shard_attention(attn: nn.Module, part: Part, sums: Sums, what: str) -> nn.Module:
    """Grouped-query attention (q/k/v/o projections, or one fused q|k|v projection) by heads, in place."""
    hname, kname, nq, nkv = _head_counts(attn, part, what)
    g = nq // nkv
    qa, qb = part.run(nq)
    ka, kb = qa // g, -(-qb // g)
    before, after = qa - ka * g, kb * g - qb
    fused = "qkv_proj" in attn
    oname = next(n for n in ATTN_OUT if n in attn)
    q, o = attn["qkv_proj" if fused else "q_proj"], attn[oname]
    wo = in_features(o) // nq
    wq = wo if fused else out_features(q) // nq  # (fused: q, k and v heads alike)
    wk = wq if fused else out_features(attn["k_proj"]) // nkv
    for name, m in attn.children().items():  # a norm over every head at once (OLMo 2's) would need them all
        if isinstance(m, NORM_TYPES) and getattr(m, "weight", None) is not None and m.weight.shape[-1] in (
                nq * wq, nkv * wk) and m.weight.shape[-1] not in (wq, wq * g):
            raise Unsplittable(f"{what}.{name}: a norm across all of its heads at once")
    take_cols(o, qa * wo, qb * wo, f"{what}.{oname}")
    if fused:  # [q | k | v] rows: this rank's of each
        k0, v0 = nq * wq, nq * wq + nkv * wk
        take_row_runs(q, [(qa * wq, qb * wq), (k0 + ka * wk, k0 + kb * wk), (v0 + ka * wk, v0 + kb * wk)])
    else:
        take_rows(q, qa * wq, qb * wq)
        for name in ("k_proj", "v_proj"):
            take_rows(attn[name], ka * wk, kb * wk)
    _per_head(attn, nq, qa, qb, (before, after))
    if before or after:
        attn["qkv_proj" if fused else "q_proj"] = PadHeads(q, before, after, wq, (qb - qa) * wq if fused else None)
    attn[oname] = SumOut(o, sums, (before * wo, (before + qb - qa) * wo) if before or after else None)
    setattr(attn, hname, (kb - ka) * g)
    if kname:
        setattr(attn, kname, kb - ka)
    return attn


def shard_latent_attention(attn: nn.Module, part: Part, sums: Sums, what: str) -> nn.Module:
    """DeepSeek's multi-head latent attention by heads, in place: the per-head projections
    (queries, ``embed_q``/``unembed_out`` or ``kv_b_proj``) sliced, the latent kept whole."""
    n = getattr(attn, "num_heads", None)
    if not isinstance(n, int) or n < part.size:
        raise Unsplittable(f"{what}: cannot tell its heads, or fewer than {part.size}")
    a, b = part.run(n)
    o = attn["o_proj"]
    wo = in_features(o) // n
    take_cols(o, a * wo, b * wo, f"{what}.o_proj")
    for name in ("q_proj", "q_b_proj", "kv_b_proj"):
        if name in attn:
            w = out_features(attn[name]) // n
            take_rows(attn[name], a * w, b * w)
    for name in ("embed_q", "unembed_out"):
        if name in attn:
            take_experts(attn[name], a, b)  # (heads, out, in): by their first axis
    _per_head(attn, n, a, b)
    attn["o_proj"] = SumOut(o, sums)
    attn.num_heads = b - a
    return attn


def _mlp_names(mlp: nn.Module) -> Optional[Tuple[Sequence[str], str]]:
    return next(((ins, out) for ins, out in MLP_NAMES if all(n in mlp for n in ins) and out in mlp), None)


def shard_mlp(mlp: nn.Module, part: Part, sums: Sums, what: str, reduce: bool = True) -> nn.Module:
    """An MLP by its intermediate columns, in place (``reduce``: summed over the group here;
    else an enclosing layer sums it). Too few quantization groups for every rank: rank 0
    holds it whole."""
    ins, out = _mlp_names(mlp)
    down = mlp[out]
    a, b = part.run(in_features(down), unit(down))
    if in_features(down) // unit(down) < part.size:  # whole on rank 0
        if part.rank:
            return SumModule(Nothing(), sums) if reduce else Nothing()
        a, b = 0, in_features(down)
    else:
        n = in_features(down)
        for name in ins:
            take_row_runs(mlp[name], [(a, b), (n + a, n + b)] if name in FUSED else [(a, b)])
        take_cols(down, a, b, f"{what}.{out}")
    if reduce:
        mlp[out] = SumOut(down, sums)
    else:
        zero_bias_off_leader(down, part)
    return mlp


def _switch(module: nn.Module) -> bool:
    """A layer of experts (mlx-lm's SwitchGLU / SwitchMLP): projections with an expert axis."""
    names = _mlp_names(module)
    return names is not None and module[names[1]].weight.ndim == 3


def shard_experts(moe: nn.Module, part: Part, sums: Sums, what: str) -> nn.Module:
    """A mixture of experts: each expert's intermediate columns where every rank gets some
    quantization groups of them, else the experts across the ranks (a router that returns
    indices and scores); shared experts by their columns; one sum over the group."""
    switches = [(n, m) for n, m in moe.children().items() if isinstance(m, nn.Module) and _switch(m)]
    if len(switches) != 1:
        raise Unsplittable(f"{what}: {len(switches)} layers of experts side by side")
    (sname, switch), = switches
    ins, out = _mlp_names(switch)
    down = switch[out]
    if in_features(down) // unit(down) >= part.size:
        a, b = part.run(in_features(down), unit(down))
        for name in ins:
            take_rows(switch[name], a, b)
        take_cols(down, a, b, f"{what}.{sname}.{out}")
        zero_bias_off_leader(down, part)
    else:
        router = moe["gate"] if "gate" in moe else None
        if router is None or isinstance(router, (nn.Linear, nn.QuantizedLinear)):
            raise Unsplittable(f"{what}: its experts' {in_features(down)} intermediate columns are fewer than "
                               f"{part.size} quantization groups, and its router's choices cannot be filtered")
        lo, hi = part.run(down.weight.shape[0])
        for name in (*ins, out):
            take_experts(switch[name], lo, hi)
        moe["gate"] = LocalExperts(router, lo, hi)
    for name, child in moe.children().items():
        if name != sname and isinstance(child, nn.Module) and _mlp_names(child) is not None:
            moe[name] = shard_mlp(child, part, sums, f"{what}.{name}", reduce=False)
    return SumModule(moe, sums)


def shard_layer(child: nn.Module, part: Part, sums: Sums, what: str) -> nn.Module:
    """One weighted sub-layer of a block, split (in place, or wrapped: the module to put back)."""
    if any(n in child for n in ATTN_OUT) and (all(n in child for n in ("q_proj", "k_proj", "v_proj"))
                                              or "qkv_proj" in child):
        return shard_attention(child, part, sums, what)
    if "o_proj" in child and ("embed_q" in child or "kv_b_proj" in child):
        return shard_latent_attention(child, part, sums, what)
    if any(isinstance(m, nn.Module) and _switch(m) for m in child.children().values()):
        return shard_experts(child, part, sums, what)
    if _mlp_names(child) is not None:
        return shard_mlp(child, part, sums, what)
    raise Unsplittable(f"{what} ({type(child).__name__}) cannot be split across ranks: only attention by heads, "
                       "MLPs and experts by columns are (not state-space, linear-attention or fused layers)")


def shard_block(block: nn.Module, part: Part, sums: Sums, what: str) -> None:
    """Every weighted sub-layer of ``block``, split for ``part``, in place."""
    for name, child in list(block.children().items()):
        if isinstance(child, nn.Module):
            if not isinstance(child, NORM_TYPES) and _has_weights(child):
                block[name] = shard_layer(child, part, sums, f"{what}.{name}")
        elif any(isinstance(m, nn.Module) and _has_weights(m) for m in
                 (child.values() if isinstance(child, dict) else child)):
            raise Unsplittable(f"{what}.{name}: a list of layers this group cannot split")


def shard_blocks(blocks: Sequence[nn.Module], first: int, part: Part, sums: Sums) -> None:
    """A stage's blocks (``first``: the index of the first), split for rank ``part``."""
    for i, block in enumerate(blocks):
        shard_block(block, part, sums, f"layer {first + i}'s {type(block).__name__}")


_WHY: Dict[tuple, Optional[str]] = {}


def why_not(config: dict, size: int) -> Optional[str]:
    """Why a model of ``config`` cannot run as groups of ``size`` ranks (None: it can): one
    line, from its blocks built lazily (nothing is computed) and split on paper."""
    import json

    key = (json.dumps(config, sort_keys=True, default=str), size)
    if key not in _WHY:
        _WHY[key] = _try_split(config, size)
    return _WHY[key]


def _build(config: dict) -> nn.Module:
    """The mlx-lm model of ``config``, lazily (nothing computed), quantized as its config says
    (per-layer entries, else where the groups fit, as mlx-lm's converter does)."""
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    quant = config.get("quantization")
    if quant:
        gs = quant.get("group_size", 64)
        nn.quantize(model, group_size=gs, bits=quant.get("bits", 4), mode=quant.get("mode", "affine"),
                    class_predicate=lambda p, m: quant[p] if p in quant else
                    hasattr(m, "to_quantized") and m.weight.shape[-1] % gs == 0)
    return model


def _try_split(config: dict, size: int) -> Optional[str]:
    from mlx.utils import tree_flatten

    from mlxpipe.shards.models.layers import layer_list

    try:
        for rank in range(size):  # every rank's cuts (a model built afresh for each: the split is in place)
            model = _build(config)
            seen = set()
            for i, block in enumerate(layer_list(model)):
                kind = (type(block), tuple((k, v.shape) for k, v in tree_flatten(block.parameters())))
                if kind not in seen:  # one block of each kind and shape
                    seen.add(kind)
                    shard_block(block, Part(rank, size), Sums(None), f"layer {i}'s {type(block).__name__}")
    except Unsplittable as err:
        return str(err)
    except Exception as err:  # noqa: BLE001 - a config mlx-lm cannot build: no group of it either
        return f"its blocks cannot be built to check ({type(err).__name__}: {err})"
    return None
