"""Partition planner: which node runs which layers, so that the slowest stage is as fast as it can be.

A pipeline decodes at the pace of its slowest stage. Cutting by layer count
leaves the last stage slow (it also runs the final norm, the output head and
the sampler) and ignores that nodes differ in memory and speed. The planner
takes a cost per layer (from a model's ``config.json``, or exact tensor bytes
from its ``*.safetensors`` headers) and a profile per node, and chooses
contiguous half-open ranges ``[start, end)`` over the nodes in the order
given, each within its node's memory (weights + KV cache), minimizing the
slowest stage's time per decode step; ties go to the smaller sum of stage
times, then to fewer stages. A node may be left out.

Pure Python: no MLX, no I/O beyond reading ``config.json`` and safetensors
headers. ``run`` is the only place that prints.
"""

from __future__ import annotations

import argparse
import itertools
import json
import logging
import math
import re
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from mlxpipe.shards.store import text_config
from mlxpipe.shards.units import expand_list, gb as _gb, parse_bandwidth, parse_size
from mlxpipe.shards.weights import LAYER_RE, read_header

logger = logging.getLogger(__name__)

DEFAULT_BANDWIDTH = 800e9      # bytes/s that `mlxpipe plan` assumes without --bandwidth


class PlanInfeasible(ValueError):
    """No assignment of layers to nodes fits; the message says why and by how much."""


# -- cost model -------------------------------------------------------------------


@dataclass(frozen=True)
class LayerCost:
    """What one decoder layer costs: in parameters, resident bytes, bytes read per token, KV cache."""

    kind: str                 # "dense" or "moe"
    params: int               # parameters held by the layer
    active_params: int        # parameters used per decoded token
    weight_bytes: int         # bytes resident on the node
    read_bytes: int           # bytes read per decoded token
    kv_bytes_per_token: int   # KV cache bytes per token of context


@dataclass(frozen=True)
class ModelCost:
    """Per-layer costs of a model plus its embedding (first stage) and final norm + head (last stage)."""

    name: str
    model_type: str
    layers: Tuple[LayerCost, ...]
    embed_params: int
    embed_bytes: int          # the token embedding (on the first stage)
    embed_read_bytes: int     # one row per decoded token
    head_params: int          # final norm + output head (tied: the embedding matrix again)
    head_bytes: int           # on the last stage
    head_read_bytes: int
    tied: bool                # output head shares the embedding matrix
    bits: Optional[int]       # None: 16-bit weights
    group_size: int
    source: str               # "config" or "safetensors"

    def __post_init__(self) -> None:
        # Weight bytes of layers [0, i): the planner asks for O(nodes x layers^2) stage weights.
        # A plain attribute, not a field: equality, repr and asdict stay as they are.
        object.__setattr__(self, "_weight_prefix",
                           list(itertools.accumulate((l.weight_bytes for l in self.layers), initial=0)))

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def total_params(self) -> int:
        head = self.head_params - (self.embed_params if self.tied else 0)
        return self.embed_params + sum(l.params for l in self.layers) + head

    @property
    def active_params(self) -> int:
        """Parameters touched per decoded token (embedding counted whole, as papers do)."""
        head = self.head_params - (self.embed_params if self.tied else 0)
        return self.embed_params + sum(l.active_params for l in self.layers) + head

    @property
    def weight_bytes(self) -> int:
        """All weights held once (a tied head is not counted twice)."""
        return self.stage_weight_bytes(0, self.num_layers)

    @property
    def read_bytes(self) -> int:
        """Bytes read per decoded token through the whole model."""
        return self.embed_read_bytes + sum(l.read_bytes for l in self.layers) + self.head_read_bytes

    def stage_weight_bytes(self, start: int, end: int) -> int:
        """Weights of a stage running layers [start, end): embedding on the first, head on the last."""
        pre = self._weight_prefix
        b = pre[end] - pre[start]
        if start == 0:
            b += self.embed_bytes
        if end == len(pre) - 1:
            b += self.head_bytes - (self.embed_bytes if self.tied and start == 0 else 0)
        return b


@dataclass(frozen=True)
class _Quant:
    """Bytes of weights: affine quantization as mlx-lm writes it, or plain 16-bit."""

    bits: Optional[int]
    group_size: int
    dtype_bytes: int

    def matrix(self, rows: int, cols: int, count: int = 1) -> int:
        # cols is the input dimension, the one groups run along.
        n = rows * cols * count
        if self.bits is None or cols % self.group_size:
            return n * self.dtype_bytes
        return n * self.bits // 8 + (n // self.group_size) * 2 * self.dtype_bytes

    def plain(self, n: int) -> int:
        return n * self.dtype_bytes


class _Parts:
    """Accumulates (params, bytes) of a layer as always-read and partly-read parts."""

    def __init__(self) -> None:
        self.params = self.active = self.bytes = self.read = 0

    def add(self, params: int, nbytes: int, fraction: float = 1.0) -> None:
        self.params += params
        self.bytes += nbytes
        self.active += round(params * fraction)
        self.read += round(nbytes * fraction)


def _dtype_bytes(cfg: dict) -> int:
    return 4 if cfg.get("torch_dtype") in ("float32", "fp32") else 2


def _num_experts(cfg: dict) -> int:
    return int(cfg.get("n_routed_experts") or cfg.get("num_experts") or cfg.get("num_local_experts") or 0)


def _is_moe(cfg: dict, i: int) -> bool:
    # The union of the rules of DeepSeek (first_k_dense_replace, moe_layer_freq),
    # Qwen-MoE (decoder_sparse_step, mlp_only_layers) and Mixtral (every layer);
    # each config only sets its own keys, the others stay neutral.
    return (_num_experts(cfg) > 0
            and i >= int(cfg.get("first_k_dense_replace") or 0)
            and i % int(cfg.get("moe_layer_freq") or 1) == 0
            and (i + 1) % int(cfg.get("decoder_sparse_step") or 1) == 0
            and i not in (cfg.get("mlp_only_layers") or []))


def _attention(cfg: dict, q: _Quant, kv_bytes: int) -> Tuple[int, int, int]:
    """(params, bytes, KV bytes per token) of one attention block and its two norms."""
    h = int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    parts = _Parts()
    parts.add(2 * h, q.plain(2 * h))                      # input + post-attention RMSNorm
    if cfg.get("kv_lora_rank"):                           # MLA (DeepSeek V2/V3)
        kvr, rope = int(cfg["kv_lora_rank"]), int(cfg["qk_rope_head_dim"])
        nope, vd = int(cfg["qk_nope_head_dim"]), int(cfg["v_head_dim"])
        qr = cfg.get("q_lora_rank")
        if qr:
            parts.add(h * qr, q.matrix(qr, h))
            parts.add(qr, q.plain(qr))
            parts.add(qr * heads * (nope + rope), q.matrix(heads * (nope + rope), qr))
        else:
            parts.add(h * heads * (nope + rope), q.matrix(heads * (nope + rope), h))
        parts.add(h * (kvr + rope), q.matrix(kvr + rope, h))
        parts.add(kvr, q.plain(kvr))
        # kv_b_proj, which mlx-lm splits into embed_q (heads, kvr, nope) and unembed_out (heads, vd, kvr)
        parts.add(heads * kvr * (nope + vd), q.matrix(heads * kvr, nope) + q.matrix(heads * vd, kvr))
        parts.add(heads * vd * h, q.matrix(h, heads * vd))
        return parts.params, parts.bytes, (kvr + rope) * kv_bytes
    kvh = int(cfg.get("num_key_value_heads") or heads)
    hd = int(cfg.get("head_dim") or h // heads)
    parts.add(h * heads * hd, q.matrix(heads * hd, h))
    parts.add(2 * h * kvh * hd, 2 * q.matrix(kvh * hd, h))
    parts.add(heads * hd * h, q.matrix(h, heads * hd))
    mt = str(cfg.get("model_type", ""))
    if cfg.get("attention_bias") or mt.startswith("qwen2"):
        parts.add((heads + 2 * kvh) * hd, q.plain((heads + 2 * kvh) * hd))
    if mt.startswith("qwen3"):                            # per-head q/k RMSNorm
        parts.add(2 * hd, q.plain(2 * hd))
    return parts.params, parts.bytes, 2 * kvh * hd * kv_bytes


def _layer(cfg: dict, i: int, q: _Quant, kv_bytes: int) -> LayerCost:
    h = int(cfg["hidden_size"])
    parts = _Parts()
    p, b, kv = _attention(cfg, q, kv_bytes)
    parts.add(p, b)
    if not _is_moe(cfg, i):
        inter = int(cfg["intermediate_size"])
        parts.add(3 * h * inter, 2 * q.matrix(inter, h) + q.matrix(h, inter))
        return LayerCost("dense", parts.params, parts.active, parts.bytes, parts.read, kv)
    n = _num_experts(cfg)
    k = int(cfg["num_experts_per_tok"])
    inter = int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"])
    parts.add(3 * n * h * inter, 2 * q.matrix(inter, h, n) + q.matrix(h, inter, n), k / n)
    parts.add(n * h, q.plain(n * h))                      # router: stays 16-bit
    shared = int(cfg.get("n_shared_experts") or 0) * inter or int(cfg.get("shared_expert_intermediate_size") or 0)
    if shared:
        parts.add(3 * h * shared, 2 * q.matrix(shared, h) + q.matrix(h, shared))
        if cfg.get("shared_expert_intermediate_size"):    # Qwen2-MoE's shared-expert gate
            parts.add(h, q.plain(h))
    return LayerCost("moe", parts.params, parts.active, parts.bytes, parts.read, kv)


def model_cost(cfg: dict, bits: Optional[int] = None, group_size: Optional[int] = None,
               kv_dtype_bytes: Optional[int] = None, name: Optional[str] = None) -> ModelCost:
    """Cost of every layer, the embedding and the head, from a Hugging Face / mlx-lm config dict.

    Quantization (``bits`` b, affine group size g, default 64, as ``mlx_lm.convert``
    does it): every linear weight -- attention projections, MLP and expert
    projections, shared experts -- and the embedding and output head cost
    b bits per weight plus a 16-bit scale and a 16-bit bias per group of g,
    i.e. b + 32/g bits, wherever the input dimension is a multiple of g. RMSNorm
    weights, biases and MoE router weights stay 16-bit (mlx-lm keeps Qwen-MoE's
    router at 8 bits, a rounding error here). ``bits=None`` (or 16) means
    unquantized 16-bit weights; when omitted, a config's own ``quantization``
    entry (an MLX folder) is used. KV cache per token per layer: GQA caches
    2 x num_key_value_heads x head_dim values; MLA, as mlx-lm caches it,
    kv_lora_rank + qk_rope_head_dim values; both in 16-bit unless
    ``kv_dtype_bytes`` says otherwise. Bytes read per decoded token: all of a
    dense layer; for a MoE layer the attention, norms, router, shared experts
    and ``num_experts_per_tok`` of the routed experts; one row of the embedding;
    all of the head.
    """
    try:
        stored = cfg.get("quantization") or {}
        if bits is None:
            bits = stored.get("bits")
        if group_size is None:
            group_size = stored.get("group_size") or 64
        if bits == 16:
            bits = None
        if bits is not None and not 1 <= bits <= 8:
            raise ValueError(f"bits must be between 1 and 8 (or 16 for unquantized), not {bits}")
        if group_size <= 0:
            raise ValueError(f"group size must be positive, not {group_size}")
        q = _Quant(bits, int(group_size), _dtype_bytes(cfg))
        kv_bytes = kv_dtype_bytes or _dtype_bytes(cfg)
        layers = tuple(_layer(cfg, i, q, kv_bytes) for i in range(int(cfg["num_hidden_layers"])))
        h, vocab = int(cfg["hidden_size"]), int(cfg["vocab_size"])
    except KeyError as e:
        raise ValueError(f"config lacks {e.args[0]!r}: is it a decoder-only language model's "
                         "config.json?") from None
    tied = bool(cfg.get("tie_word_embeddings", False))
    embed = q.matrix(vocab, h)
    head = embed + q.plain(h)                             # output projection + final RMSNorm
    return ModelCost(
        name=name or (cfg.get("architectures") or [""])[0] or cfg.get("model_type", "model"),
        model_type=str(cfg.get("model_type", "")),
        layers=layers,
        embed_params=vocab * h, embed_bytes=embed, embed_read_bytes=q.matrix(1, h),
        head_params=vocab * h + h, head_bytes=head, head_read_bytes=head,
        tied=tied, bits=bits, group_size=int(group_size), source="config",
    )


def read_safetensors_header(path: Path) -> Dict[str, dict]:
    """Tensor entries of a .safetensors file (name -> dtype, shape, data_offsets), header only."""
    header, _ = read_header(path)
    header.pop("__metadata__", None)
    return header


_ROUTED_RE = re.compile(r"switch_mlp\.|\.experts\.\d+\.|block_sparse_moe\.experts\.")


def _from_safetensors(cost: ModelCost, cfg: dict, files: Sequence[Path]) -> ModelCost:
    """``cost`` with exact weight and read bytes taken from the tensors' headers."""
    L = cost.num_layers
    layer_bytes, routed = [0] * L, [0] * L
    embed = head = 0
    has_head = False
    for path in files:
        for name, t in read_safetensors_header(path).items():
            try:
                start, end = t["data_offsets"]
                nbytes = int(end) - int(start)
            except (KeyError, TypeError, ValueError):
                raise ValueError(f"{path}: tensor {name!r} has no valid data_offsets") from None
            m = LAYER_RE.search(name)
            if m:
                i = int(m.group(1))
                if i < L:                                 # beyond: MTP layers that mlx-lm drops
                    layer_bytes[i] += nbytes
                    if _ROUTED_RE.search(name) and "shared" not in name:
                        routed[i] += nbytes
            elif "embed_tokens" in name or name.endswith("wte.weight"):
                embed += nbytes
            else:
                head += nbytes
                has_head |= "lm_head" in name
    k = int(cfg.get("num_experts_per_tok") or 0)
    n = _num_experts(cfg)
    layers = []
    for i, l in enumerate(cost.layers):
        skipped = routed[i] * (1 - k / n) if l.kind == "moe" and n else 0
        layers.append(LayerCost(l.kind, l.params, l.active_params, layer_bytes[i],
                                round(layer_bytes[i] - skipped), l.kv_bytes_per_token))
    tied = not has_head
    head_total = head + (embed if tied else 0)
    vocab = int(cfg["vocab_size"])
    return ModelCost(cost.name, cost.model_type, tuple(layers), cost.embed_params, embed,
                     -(-embed // vocab), cost.head_params, head_total, head_total, tied,
                     cost.bits, cost.group_size, "safetensors")


def load_model_cost(path: str | Path, bits: Optional[int] = None,
                    group_size: Optional[int] = None) -> ModelCost:
    """Cost of the model at ``path``: a config.json file, or a folder holding one.

    When the folder also holds ``*.safetensors`` files and ``bits`` is unset or
    matches the folder's own quantization, weight bytes are the exact tensor
    sizes from the headers (the tensors themselves are never read).
    """
    p = Path(path)
    cfg_path = p / "config.json" if p.is_dir() else p
    if not cfg_path.is_file():
        raise ValueError(f"no config.json at {p}")
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {cfg_path}: {e}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{cfg_path} is not a JSON object")
    cfg = text_config(cfg) if "num_hidden_layers" not in cfg else cfg
    name = p.name if p.is_dir() else (p.parent.name if p.name == "config.json" else p.stem)
    cost = model_cost(cfg, bits, group_size, name=name)
    files = sorted(p.glob("*.safetensors")) if p.is_dir() else []
    stored = cfg.get("quantization") or {}
    if files and (bits is None or (bits == stored.get("bits") and cost.group_size == stored.get("group_size"))):
        return _from_safetensors(cost, cfg, files)
    if files:
        logger.info("%s holds weights of another precision; sizes computed from config.json", p)
    return cost


# -- nodes -------------------------------------------------------------------------


@dataclass(frozen=True)
class NodeSpec:
    """One node: its memory budget (weights + KV cache) and its speed, on paper or measured.

    On paper: ``bandwidth_bytes_per_s``, and a stage's time is the bytes it
    reads per decoded token over that bandwidth. Measured: ``layer_seconds``
    maps a layer kind ("dense", "moe") to seconds per decoded token for one
    layer, ``head_seconds`` the final norm + output head + sampling and
    ``embed_seconds`` the embedding; measured figures win where both are given.
    """

    name: str
    memory_bytes: int
    bandwidth_bytes_per_s: Optional[float] = None
    layer_seconds: Optional[Dict[str, float]] = None
    embed_seconds: float = 0.0
    head_seconds: Optional[float] = None

    def times(self, cost: ModelCost) -> Tuple[List[float], float, float]:
        """Seconds per decoded token: of each layer, of the embedding, of the head."""
        bw = self.bandwidth_bytes_per_s
        if bw is not None and not bw > 0:
            raise ValueError(f"node {self.name}: bandwidth must be positive")
        if self.layer_seconds is not None:
            missing = {l.kind for l in cost.layers} - set(self.layer_seconds)
            if missing:
                raise ValueError(f"node {self.name}: layer_seconds lacks {sorted(missing)}")
            layers = [float(self.layer_seconds[l.kind]) for l in cost.layers]
        elif bw:
            layers = [l.read_bytes / bw for l in cost.layers]
        else:
            raise ValueError(f"node {self.name}: give bandwidth_bytes_per_s or layer_seconds")
        embed = self.embed_seconds + (cost.embed_read_bytes / bw if bw and self.layer_seconds is None else 0.0)
        if self.head_seconds is not None:
            head = self.head_seconds
        elif bw:
            head = cost.head_read_bytes / bw
        else:
            raise ValueError(f"node {self.name}: measured layer_seconds need head_seconds too")
        if min(layers, default=0.0) < 0 or embed < 0 or head < 0:
            raise ValueError(f"node {self.name}: times must not be negative")
        return layers, embed, head


# -- the plan ----------------------------------------------------------------------


@dataclass(frozen=True)
class Stage:
    """One node's share of the pipeline."""

    node_index: int
    node: str
    start: int
    end: int                  # half-open: layers [start, end)
    weight_bytes: int
    kv_bytes: int
    seconds: float            # predicted seconds per decode step, hop included

    @property
    def num_layers(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Plan:
    """Stages in pipeline order, with the decode speed they predict."""

    stages: Tuple[Stage, ...]
    num_layers: int
    unused: Tuple[str, ...]   # nodes given no layers

    @property
    def ranges(self) -> List[Tuple[int, int]]:
        return [(s.start, s.end) for s in self.stages]

    @property
    def max_seconds(self) -> float:
        return max(s.seconds for s in self.stages)

    @property
    def sum_seconds(self) -> float:
        return sum(s.seconds for s in self.stages)

    @property
    def tokens_per_s_one_stream(self) -> float:
        """One sequence: each token passes every stage (and hop) in turn."""
        return 1.0 / self.sum_seconds

    @property
    def tokens_per_s_pipeline(self) -> float:
        """One stream per stage-group in flight, every stage busy: the slowest stage sets the pace."""
        n = len(self.stages)
        return n / max(self.sum_seconds, n * self.max_seconds)

    def to_dict(self) -> dict:
        return {
            "stages": [dict(asdict(s), num_layers=s.num_layers) for s in self.stages],
            "unused_nodes": list(self.unused),
            "num_layers": self.num_layers,
            "max_stage_seconds": self.max_seconds,
            "sum_stage_seconds": self.sum_seconds,
            "tokens_per_s_one_stream": self.tokens_per_s_one_stream,
            "tokens_per_s_pipeline": self.tokens_per_s_pipeline,
        }


def _solve(L: int, N: int, time: Callable[[int, int, int], float],
           fits: Callable[[int, int, int], bool], skip: bool) -> Optional[List[Tuple[int, int, int]]]:
    """Stages (node, start, end) over nodes 0..N-1 in order covering [0, L), or None if none fits.

    Minimizes the slowest stage, then the sum of stage times, then the number
    of stages. Two exact dynamic programmes over (node prefix, layer prefix):
    the first finds the least possible maximum T (max composes monotonically);
    the second, among stages no slower than T, minimizes (sum, count), which
    add up stage by stage. ``skip`` lets a node take no layers. Stage time and
    memory never decrease as a stage grows, so scanning starts downward may stop
    at the first miss. O(N L^2).
    """
    INF = math.inf
    best = [0.0] + [INF] * L
    for n in range(N):
        row = list(best) if skip else [INF] * (L + 1)
        for e in range(1, L + 1):
            v = row[e]
            for s in range(e - 1, -1, -1):
                if not fits(n, s, e):
                    break
                if best[s] < v:
                    c = max(best[s], time(n, s, e))
                    if c < v:
                        v = c
            row[e] = v
        best = row
    limit = best[L]
    if limit == INF:
        return None
    # Second pass: g[e] = (sum, count) of the best prefix ending at layer e; back[n][e] its last stage start.
    g: List[Optional[Tuple[float, int]]] = [(0.0, 0)] + [None] * L
    back: List[List[int]] = []
    for n in range(N):
        row = list(g) if skip else [None] * (L + 1)
        brow = [-1] * (L + 1)                             # -1: node n unused for this prefix
        for e in range(1, L + 1):
            for s in range(e - 1, -1, -1):
                if not fits(n, s, e):
                    break
                t = time(n, s, e)
                if t > limit:
                    break
                if g[s] is None:
                    continue
                cand = (g[s][0] + t, g[s][1] + 1)
                if row[e] is None or cand < row[e]:
                    row[e], brow[e] = cand, s
        g = row
        back.append(brow)
    stages, e = [], L
    for n in range(N - 1, -1, -1):
        s = back[n][e]
        if s >= 0:
            stages.append((n, s, e))
            e = s
    assert e == 0, "planner back-pointers lost a layer"
    return stages[::-1]


class _Problem:
    """Precomputed stage times and memory of one (model, nodes, context) question."""

    def __init__(self, cost: ModelCost, nodes: Sequence[NodeSpec], context: int,
                 concurrency: int, hop_seconds: float) -> None:
        if not nodes:
            raise ValueError("no nodes given")
        if cost.num_layers < 1:
            raise ValueError("the model has no layers")
        if context < 1 or concurrency < 1:
            raise ValueError("context and concurrency must be at least 1")
        if hop_seconds < 0:
            raise ValueError("hop time must not be negative")
        for node in nodes:
            if node.memory_bytes <= 0:
                raise ValueError(f"node {node.name}: memory must be positive")
        self.cost, self.nodes, self.hop = cost, list(nodes), hop_seconds
        self.L, self.N = cost.num_layers, len(nodes)
        tokens = context * concurrency
        self.weights = cost.stage_weight_bytes    # (start, end) -> bytes: the one formula, on prefix sums
        self.kvpre = list(itertools.accumulate((l.kv_bytes_per_token * tokens for l in cost.layers), initial=0))
        self.tpre, self.embed_t, self.head_t = [], [], []
        for node in nodes:
            layers, embed, head = node.times(cost)
            self.tpre.append(list(itertools.accumulate(layers, initial=0.0)))
            self.embed_t.append(embed)
            self.head_t.append(head)

    def kv(self, s: int, e: int) -> int:
        return self.kvpre[e] - self.kvpre[s]

    def fits(self, n: int, s: int, e: int) -> bool:
        return self.weights(s, e) + self.kv(s, e) <= self.nodes[n].memory_bytes

    def time(self, n: int, s: int, e: int) -> float:
        t = self.tpre[n][e] - self.tpre[n][s] + self.hop
        if s == 0:
            t += self.embed_t[n]
        if e == self.L:
            t += self.head_t[n]
        return t

    def plan(self, stages: Sequence[Tuple[int, int, int]]) -> Plan:
        out = tuple(Stage(n, self.nodes[n].name, s, e, self.weights(s, e), self.kv(s, e), self.time(n, s, e))
                    for n, s, e in stages)
        used = {n for n, _, _ in stages}
        return Plan(out, self.L, tuple(node.name for i, node in enumerate(self.nodes) if i not in used))

    def infeasible(self) -> PlanInfeasible:
        need = self.weights(0, self.L) + self.kv(0, self.L)
        have = sum(n.memory_bytes for n in self.nodes)
        if need > have:
            return PlanInfeasible(f"needs {_gb(need)} for weights and KV cache, the nodes have "
                                  f"{_gb(have)}: {_gb(need - have)} short")
        largest = max(n.memory_bytes for n in self.nodes)
        for i in range(self.L):
            one = self.weights(i, i + 1) + self.kv(i, i + 1)
            if one > largest:
                extra = " with the embedding" if i == 0 else " with the output head" if i == self.L - 1 else ""
                return PlanInfeasible(f"layer {i} ({self.cost.layers[i].kind}{extra}) needs {_gb(one)} with its "
                                      f"KV cache and fits on no node: the largest has {_gb(largest)}")
        return PlanInfeasible(f"needs {_gb(need)} for weights and KV cache and the nodes have {_gb(have)}, but no "
                              f"contiguous split of the {self.L} layers fits the nodes in the order given: "
                              f"{_gb(have - need)} to spare is too little to round up to whole layers")


def plan(cost: ModelCost, nodes: Sequence[NodeSpec], *, context: int = 8192, concurrency: int = 1,
         hop_seconds: float = 0.0, every_node: bool = False) -> Plan:
    """The best contiguous split of the model's layers over ``nodes``, in the order given.

    Every layer runs exactly once; each stage's weights plus KV cache for
    ``context`` x ``concurrency`` tokens fit its node's ``memory_bytes``. A
    stage's time is its layers' times, plus the embedding on the first stage,
    the head on the last, and ``hop_seconds`` for sending its output on. The
    slowest stage is minimized, then the sum of stage times, then the number of
    stages; a node may get no layers, unless ``every_node`` (stages that are
    already running, such as local stage processes). Raises ``PlanInfeasible``
    when nothing fits.
    """
    if every_node and len(nodes) > cost.num_layers:
        raise PlanInfeasible(f"cannot give each of {len(nodes)} nodes one of {cost.num_layers} layers")
    prob = _Problem(cost, nodes, context, concurrency, hop_seconds)
    stages = _solve(prob.L, prob.N, prob.time, prob.fits, skip=not every_node)
    if stages is None:
        raise prob.infeasible()
    return prob.plan(stages)


def brute_force(cost: ModelCost, nodes: Sequence[NodeSpec], *, context: int = 8192, concurrency: int = 1,
                hop_seconds: float = 0.0) -> Plan:
    """What ``plan`` answers, by trying every assignment (exponential: for checking it on small cases)."""
    prob = _Problem(cost, nodes, context, concurrency, hop_seconds)
    L, N = prob.L, prob.N
    best_key, best = None, None
    for k in range(1, min(N, L) + 1):
        for chosen in itertools.combinations(range(N), k):
            for cuts in itertools.combinations(range(1, L), k - 1):
                bounds = (0, *cuts, L)
                stages = [(n, bounds[j], bounds[j + 1]) for j, n in enumerate(chosen)]
                if not all(prob.fits(n, s, e) for n, s, e in stages):
                    continue
                times = [prob.time(n, s, e) for n, s, e in stages]
                key = (max(times), sum(times), k)
                if best_key is None or key < best_key:
                    best_key, best = key, stages
    if best is None:
        raise prob.infeasible()
    return prob.plan(best)


def balanced_ranges(num_layers: int, layer_seconds: Sequence[float], embed_seconds: float,
                    head_seconds: float, stages: int, memory: Optional[Sequence[int]] = None,
                    layer_bytes: Optional[Sequence[int]] = None) -> List[Tuple[int, int]]:
    """Exactly ``stages`` non-empty half-open ranges covering [0, num_layers), slowest stage minimized.

    ``layer_seconds`` gives each layer's time; the first stage also pays
    ``embed_seconds`` and the last ``head_seconds``. With ``memory`` (bytes per
    stage) and ``layer_bytes`` (bytes per layer, KV cache included; fold the
    embedding into layer 0 and the head into the last layer), every range fits
    its stage. Ties go to the smaller sum of stage times.
    """
    if len(layer_seconds) != num_layers:
        raise ValueError(f"{len(layer_seconds)} layer times for {num_layers} layers")
    if not 1 <= stages <= num_layers:
        raise ValueError(f"cannot cut {num_layers} layers into {stages} non-empty stages")
    if (memory is None) != (layer_bytes is None):
        raise ValueError("give memory and layer_bytes together")
    if memory is not None and (len(memory) != stages or len(layer_bytes) != num_layers):
        raise ValueError(f"memory needs {stages} entries and layer_bytes {num_layers}")
    tpre = list(itertools.accumulate((float(t) for t in layer_seconds), initial=0.0))
    bpre = list(itertools.accumulate(layer_bytes or [0] * num_layers, initial=0))

    def time(n: int, s: int, e: int) -> float:
        return tpre[e] - tpre[s] + (embed_seconds if s == 0 else 0.0) + (head_seconds if e == num_layers else 0.0)

    def fits(n: int, s: int, e: int) -> bool:
        return memory is None or bpre[e] - bpre[s] <= memory[n]

    found = _solve(num_layers, stages, time, fits, skip=False)
    if found is None:
        raise PlanInfeasible(f"no split of {num_layers} layers into {stages} stages fits: the layers need "
                             f"{_gb(bpre[-1])}, the stages have {_gb(sum(memory or []))}")
    return [(s, e) for _, s, e in found]


# -- the command -------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Options of ``mlxpipe plan``."""
    p.add_argument("--model", required=True,
                   help="model folder (config.json, and *.safetensors if present) or a config.json file")
    p.add_argument("--nodes", required=True,
                   help="memory budget per node for weights + KV cache, in pipeline order, "
                        "e.g. 144GB,144GB or 3x144GB or studio=384GB,mini=48GB")
    p.add_argument("--bits", type=int, default=None,
                   help="quantize to this many bits (default: the folder's own quantization, else 16-bit)")
    p.add_argument("--group-size", type=int, default=None, help="quantization group size (default 64)")
    p.add_argument("--context", type=int, default=8192, help="tokens of KV cache per stream (default 8192)")
    p.add_argument("--concurrency", type=int, default=1, help="streams whose KV cache must fit (default 1)")
    p.add_argument("--bandwidth", default=None,
                   help="memory bandwidth, one for all nodes or one per node, e.g. 800GB/s "
                        f"(default {DEFAULT_BANDWIDTH / 1e9:.0f}GB/s)")
    p.add_argument("--hop-ms", type=float, default=0.0, help="link time per stage hop in ms (default 0)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")


def _nodes_from_args(args) -> Tuple[List[NodeSpec], bool]:
    items = expand_list(args.nodes)
    if not items:
        raise ValueError("--nodes lists no node")
    names, sizes = [], []
    for i, item in enumerate(items):
        name, _, size = item.rpartition("=")
        names.append(name.strip() or f"node{i}")
        sizes.append(parse_size(size))
    assumed = args.bandwidth is None
    bws = [DEFAULT_BANDWIDTH] if assumed else [parse_bandwidth(b) for b in expand_list(args.bandwidth)]
    if len(bws) == 1:
        bws *= len(items)
    if len(bws) != len(items):
        raise ValueError(f"--bandwidth gives {len(bws)} values for {len(items)} nodes: give one, or one per node")
    return [NodeSpec(n, m, bandwidth_bytes_per_s=b) for n, m, b in zip(names, sizes, bws)], assumed


def _summary(cost: ModelCost, args) -> dict:
    kinds = [l.kind for l in cost.layers]
    kv_token = sum(l.kv_bytes_per_token for l in cost.layers)
    return {
        "model": cost.name, "model_type": cost.model_type, "num_layers": cost.num_layers,
        "dense_layers": kinds.count("dense"), "moe_layers": kinds.count("moe"),
        "bits": cost.bits, "group_size": cost.group_size if cost.bits else None, "sizes_from": cost.source,
        "params": cost.total_params, "active_params": cost.active_params,
        "weight_bytes": cost.weight_bytes, "read_bytes_per_token": cost.read_bytes,
        "kv_bytes_per_token": kv_token, "context": args.context, "concurrency": args.concurrency,
    }


def _table(rows: List[List[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]

    def cell(j: int, c: str) -> str:  # numbers right-aligned
        return c.rjust(widths[j]) if j >= 3 else c.ljust(widths[j])

    return "\n".join("  ".join(cell(j, c) for j, c in enumerate(r)).rstrip() for r in rows)


def run(args) -> int:
    """``mlxpipe plan``: print the best split (a table, or JSON with --json); 2 when nothing fits."""
    try:
        nodes, assumed = _nodes_from_args(args)
        cost = load_model_cost(args.model, args.bits, args.group_size)
        summary = _summary(cost, args)
        result = plan(cost, nodes, context=args.context, concurrency=args.concurrency,
                      hop_seconds=args.hop_ms / 1000)
    except ValueError as e:
        if args.json:
            print(json.dumps({"feasible": False, "error": str(e)}, indent=2))
        else:
            print(f"mlxpipe plan: {e}", file=sys.stderr)
        return 2
    note = (f"bandwidth: {DEFAULT_BANDWIDTH / 1e9:.0f} GB/s assumed for every node (no --bandwidth given)"
            if assumed else None)
    if args.json:
        print(json.dumps({"feasible": True, **summary, "bandwidth_assumed": assumed,
                          "nodes": [asdict(n) for n in nodes], **result.to_dict()}, indent=2))
        return 0
    quant = f"{cost.bits}-bit, group {cost.group_size}" if cost.bits else "16-bit"
    print(f"{cost.name}: {cost.num_layers} layers ({summary['dense_layers']} dense, {summary['moe_layers']} MoE), "
          f"{quant}, {cost.total_params / 1e9:.1f}B parameters ({cost.active_params / 1e9:.1f}B per token)")
    print(f"weights {_gb(cost.weight_bytes)} (sizes from {cost.source}), {_gb(cost.read_bytes)} read per token; "
          f"KV cache {summary['kv_bytes_per_token'] / 1e3:.1f} KB per token x {args.context} tokens "
          f"x {args.concurrency} stream(s)")
    if note:
        print(note)
    print()
    rows = [["stage", "node", "layers", "#layers", "weights GB", "KV GB", "ms/token"]]
    for i, s in enumerate(result.stages):
        rows.append([str(i), s.node, f"[{s.start}, {s.end})", str(s.num_layers), f"{s.weight_bytes / 1e9:.1f}",
                     f"{s.kv_bytes / 1e9:.2f}", f"{s.seconds * 1e3:.2f}"])
    print(_table(rows))
    if result.unused:
        print(f"left out: {', '.join(result.unused)}")
    print()
    print(f"predicted decode: {result.tokens_per_s_one_stream:.1f} tokens/s for one stream, "
          f"{result.tokens_per_s_pipeline:.1f} tokens/s in all with {len(result.stages)} streams in flight "
          f"(one per stage); bandwidth-bound estimate, an upper bound")
    return 0
