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
from typing import Callable, Dict, Optional, Sequence, Tuple

from mlxpipe.shards.models.store import text_config
from mlxpipe.shards.models.weights import LAYER_RE, is_vision, read_header
from mlxpipe.server.cluster.weight_bytes import Parts, Quant, Scheme
from mlxpipe.shards.params.quant import BITS, DEFAULT_GROUP_SIZE, QuantSpec

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
    quant_params: int = 0     # parameters in quantized matrices
    quant_bits: int = 0       # their bits, summed over parameters (quant_bits / quant_params: mean bits)


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
    bits: Optional[int]       # None: 16-bit weights (or per-layer rungs: see quant)
    group_size: int
    source: str               # "config" or "safetensors"
    quant: Optional[QuantSpec] = None  # the rungs costed, when quantizing a full-precision model
    ends_quant_params: int = 0  # quantized parameters of the embedding and an untied head
    ends_quant_bits: int = 0
    kv_dtype_bytes: int = 2     # bytes of a cached key or value at 16 bits (the model's dtype)
    kv_bits: int = 16           # the KV-cache precision ``kv_bytes_per_token`` is at (``context.at_kv_bits``)
    kv_group_size: int = DEFAULT_GROUP_SIZE
    max_positions: Optional[int] = None  # the model's own context (max_position_embeddings)

    def __post_init__(self) -> None:
        # Weight bytes of layers [0, i): the planner asks for O(nodes x layers^2) stage weights.
        # A plain attribute, not a field: equality, repr and asdict stay as they are.
        object.__setattr__(self, "_weight_prefix",
                           list(itertools.accumulate((l.weight_bytes for l in self.layers), initial=0)))

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def kv_bytes_per_token(self) -> int:
        """KV-cache bytes of one position through every layer."""
        return sum(l.kv_bytes_per_token for l in self.layers)

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

    @property
    def mean_bits(self) -> Optional[float]:
        """Nominal bits per quantized weight, over the whole model (scales and biases not counted)."""
        params = self.ends_quant_params + sum(l.quant_params for l in self.layers)
        bits = self.ends_quant_bits + sum(l.quant_bits for l in self.layers)
        return bits / params if params else None

    def stage_mean_bits(self, start: int, end: int) -> Optional[float]:
        """Nominal bits per quantized weight of layers [start, end)."""
        params = sum(l.quant_params for l in self.layers[start:end])
        return sum(l.quant_bits for l in self.layers[start:end]) / params if params else None

    def stage_weight_bytes(self, start: int, end: int) -> int:
        """Weights of a stage running layers [start, end): embedding on the first, head on the last."""
        pre = self._weight_prefix
        b = pre[end] - pre[start]
        if start == 0:
            b += self.embed_bytes
        if end == len(pre) - 1:
            b += self.head_bytes - (self.embed_bytes if self.tied and start == 0 else 0)
        return b


def _dtype_bytes(cfg: dict) -> int:
    return 4 if cfg.get("torch_dtype") in ("float32", "fp32") else 2


def _num_experts(cfg: dict) -> int:
    return int(cfg.get("n_routed_experts") or cfg.get("num_experts") or cfg.get("num_local_experts") or 0)


def _moe_freq(cfg: dict, i: int) -> bool:
    """DeepSeek's ``moe_layer_freq``: every n-th layer, or (MiMo-V2, MiniMax-M3) one flag per layer."""
    freq = cfg.get("moe_layer_freq") or 1
    if isinstance(freq, list):
        return i < len(freq) and bool(freq[i])
    return i % int(freq) == 0


def _is_moe(cfg: dict, i: int) -> bool:
    # The union of the rules of DeepSeek (first_k_dense_replace, moe_layer_freq),
    # Qwen-MoE (decoder_sparse_step, mlp_only_layers) and Mixtral (every layer);
    # each config only sets its own keys, the others stay neutral.
    return (_num_experts(cfg) > 0
            and i >= int(cfg.get("first_k_dense_replace") or 0)
            and _moe_freq(cfg, i)
            and (i + 1) % int(cfg.get("decoder_sparse_step") or 1) == 0
            and i not in (cfg.get("mlp_only_layers") or []))


def _attention(cfg: dict, q: Callable[[str], Quant], parts: Parts) -> int:
    """Adds one attention block and its two norms to ``parts``; returns its KV values per token.
    ``q`` gives the quantization of a module of the block by its name."""
    h = int(cfg["hidden_size"])
    heads = int(cfg["num_attention_heads"])
    plain = q("input_layernorm").plain
    parts.add(2 * h, plain(2 * h))                        # input + post-attention RMSNorm
    if cfg.get("kv_lora_rank"):                           # MLA (DeepSeek V2/V3)
        kvr, rope = int(cfg["kv_lora_rank"]), int(cfg["qk_rope_head_dim"])
        nope, vd = int(cfg["qk_nope_head_dim"]), int(cfg["v_head_dim"])
        qr = cfg.get("q_lora_rank")
        if qr:
            parts.matrix(q("self_attn.q_a_proj"), qr, h)
            parts.add(qr, plain(qr))
            parts.matrix(q("self_attn.q_b_proj"), heads * (nope + rope), qr)
        else:
            parts.matrix(q("self_attn.q_proj"), heads * (nope + rope), h)
        parts.matrix(q("self_attn.kv_a_proj_with_mqa"), kvr + rope, h)
        parts.add(kvr, plain(kvr))
        # kv_b_proj, which mlx-lm splits into embed_q (heads, kvr, nope) and unembed_out (heads, vd, kvr)
        parts.matrix(q("self_attn.embed_q"), heads * kvr, nope)
        parts.matrix(q("self_attn.unembed_out"), heads * vd, kvr)
        parts.matrix(q("self_attn.o_proj"), h, heads * vd)
        return kvr + rope
    kvh = int(cfg.get("num_key_value_heads") or heads)
    hd = int(cfg.get("head_dim") or h // heads)
    parts.matrix(q("self_attn.q_proj"), heads * hd, h)
    parts.matrix(q("self_attn.k_proj"), kvh * hd, h)
    parts.matrix(q("self_attn.v_proj"), kvh * hd, h)
    parts.matrix(q("self_attn.o_proj"), h, heads * hd)
    mt = str(cfg.get("model_type", ""))
    if cfg.get("attention_bias") or mt.startswith("qwen2"):
        parts.add((heads + 2 * kvh) * hd, plain((heads + 2 * kvh) * hd))
    if mt.startswith("qwen3"):                            # per-head q/k RMSNorm
        parts.add(2 * hd, plain(2 * hd))
    return 2 * kvh * hd


def _layer(cfg: dict, i: int, scheme: Scheme, kv_dtype: int) -> LayerCost:
    h = int(cfg["hidden_size"])
    parts = Parts()
    q = lambda name: scheme(f"model.layers.{i}.{name}")  # noqa: E731
    kv = _attention(cfg, q, parts) * kv_dtype
    if not _is_moe(cfg, i):
        inter = int(cfg["intermediate_size"])
        parts.matrix(q("mlp.gate_proj"), inter, h)
        parts.matrix(q("mlp.up_proj"), inter, h)
        parts.matrix(q("mlp.down_proj"), h, inter)
        return LayerCost("dense", parts.params, parts.active, parts.bytes, parts.read, kv, parts.qparams, parts.qbits)
    n = _num_experts(cfg)
    k = int(cfg["num_experts_per_tok"])
    inter = int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"])
    parts.matrix(q("mlp.switch_mlp.gate_proj"), inter, h, n, k / n)
    parts.matrix(q("mlp.switch_mlp.up_proj"), inter, h, n, k / n)
    parts.matrix(q("mlp.switch_mlp.down_proj"), h, inter, n, k / n)
    parts.add(n * h, q("mlp.gate").plain(n * h))          # router: stays 16-bit
    if cfg.get("topk_method") == "noaux_tc":              # DeepSeek-V3's e_score_correction_bias: float32
        parts.add(n, 4 * n)
    shared = int(cfg.get("n_shared_experts") or 0) * inter or int(cfg.get("shared_expert_intermediate_size") or 0)
    if shared:
        parts.matrix(q("mlp.shared_experts.gate_proj"), shared, h)
        parts.matrix(q("mlp.shared_experts.up_proj"), shared, h)
        parts.matrix(q("mlp.shared_experts.down_proj"), h, shared)
        if cfg.get("shared_expert_intermediate_size"):    # Qwen2-MoE's shared-expert gate
            parts.add(h, q("mlp.shared_expert_gate").plain(h))
    return LayerCost("moe", parts.params, parts.active, parts.bytes, parts.read, kv, parts.qparams, parts.qbits)


def _bits_and_group(cfg: dict, bits: Optional[int], group_size: Optional[int],
                    quant: Optional[QuantSpec]) -> Tuple[Optional[int], int]:
    """The bits (None: 16-bit) and group size to cost: ``quant``'s, else those given, else the config's own."""
    if quant is not None:
        bits, group_size = (int(quant.bits) if quant.layer_bits is None and quant.bits in BITS else None,
                            quant.group_size)
    stored = cfg.get("quantization") or {}
    bits = stored.get("bits") if bits is None else bits
    group_size = (stored.get("group_size") or DEFAULT_GROUP_SIZE) if group_size is None else group_size
    if bits is not None and bits != 16 and not 1 <= bits <= 8:
        raise ValueError(f"bits must be between 1 and 8 (or 16 for unquantized), not {bits}")
    if group_size <= 0:
        raise ValueError(f"group size must be positive, not {group_size}")
    return (None if bits == 16 else bits), int(group_size)


def model_cost(cfg: dict, bits: Optional[int] = None, group_size: Optional[int] = None,
               kv_dtype_bytes: Optional[int] = None, name: Optional[str] = None,
               quant: Optional[QuantSpec] = None) -> ModelCost:
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
    all of the head. ``quant`` (which wins over ``bits`` and ``group_size``)
    gives each layer its own rung, and mixed recipes their bits module by module.
    """
    bits, group_size = _bits_and_group(cfg, bits, group_size, quant)
    try:
        num_layers = int(cfg["num_hidden_layers"])
        if quant is not None:
            quant.check_layers(num_layers)
        scheme = Scheme(bits, int(group_size), _dtype_bytes(cfg), quant, num_layers)
        kv_dtype = kv_dtype_bytes or _dtype_bytes(cfg)
        layers = tuple(_layer(cfg, i, scheme, kv_dtype) for i in range(num_layers))
        h, vocab = int(cfg["hidden_size"]), int(cfg["vocab_size"])
    except KeyError as e:
        raise ValueError(f"config lacks {e.args[0]!r}: is it a decoder-only language model's "
                         "config.json?") from None
    tied = bool(cfg.get("tie_word_embeddings", False))
    ends = Parts()
    q = scheme("model.embed_tokens")
    ends.matrix(q, vocab, h)
    embed = ends.bytes
    qh = q if tied else scheme("lm_head")                 # a tied head is the embedding
    head = qh.matrix(vocab, h) + q.plain(h)               # output projection + final RMSNorm
    if not tied:
        ends.matrix(qh, vocab, h)
    return ModelCost(
        name=name or (cfg.get("architectures") or [""])[0] or cfg.get("model_type", "model"),
        model_type=str(cfg.get("model_type", "")),
        layers=layers,
        embed_params=vocab * h, embed_bytes=embed, embed_read_bytes=q.matrix(1, h),
        head_params=vocab * h + h, head_bytes=head, head_read_bytes=head,
        tied=tied, bits=bits, group_size=int(group_size), source="config",
        quant=quant, ends_quant_params=ends.qparams, ends_quant_bits=ends.qbits, kv_dtype_bytes=kv_dtype,
        max_positions=int(cfg.get("max_position_embeddings") or 0) or None,
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
            if is_vision(name):  # a vision model's tower: the head's (server/cluster/vision.py), no stage's
                continue
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
                                round(layer_bytes[i] - skipped), l.kv_bytes_per_token, l.quant_params,
                                l.quant_bits))
    tied = not has_head
    head_total = head + (embed if tied else 0)
    vocab = int(cfg["vocab_size"])
    return ModelCost(cost.name, cost.model_type, tuple(layers), cost.embed_params, embed,
                     -(-embed // vocab), cost.head_params, head_total, head_total, tied,
                     cost.bits, cost.group_size, "safetensors", cost.quant, cost.ends_quant_params,
                     cost.ends_quant_bits, cost.kv_dtype_bytes, max_positions=cost.max_positions)


def load_model_cost(path: str | Path, bits: Optional[int] = None,
                    group_size: Optional[int] = None, quant: Optional[QuantSpec] = None) -> ModelCost:
    """Cost of the model at ``path``: a config.json file, or a folder holding one.

    When the folder also holds ``*.safetensors`` files and ``bits`` is unset or
    matches the folder's own quantization, weight bytes are the exact tensor
    sizes from the headers (the tensors themselves are never read). ``quant``:
    the cost once a full-precision model is quantized so (from the config).
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
    cost = model_cost(cfg, bits, group_size, name=name, quant=quant)
    files = sorted(p.glob("*.safetensors")) if p.is_dir() and quant is None else []
    stored = cfg.get("quantization") or {}
    if files and (bits is None or (bits == stored.get("bits") and cost.group_size == stored.get("group_size"))):
        return _from_safetensors(cost, cfg, files)
    if files:
        logger.info("%s holds weights of another precision; sizes computed from config.json", p)
    return cost
