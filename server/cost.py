"""The paper cost model: what each layer of a model holds, reads per decoded token and caches.

From a Hugging Face / mlx-lm ``config.json`` alone (``model_cost``), or with
exact tensor bytes from a model folder's ``*.safetensors`` headers
(``load_model_cost``). The planner (``planner.py``) turns these costs into
stage times and memory. Pure Python: no MLX, no I/O beyond reading
``config.json`` and safetensors headers.

Attention (GQA, MLA) and MLP (dense, MoE) shapes are read from the config's
own keys; a new architecture whose layers differ from these may need its
shapes added here (docs/planning.md).
"""

from __future__ import annotations

import itertools
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional, Sequence, Tuple

from mlxpipe.shards.store import text_config
from mlxpipe.shards.weights import LAYER_RE, read_header

logger = logging.getLogger(__name__)


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
