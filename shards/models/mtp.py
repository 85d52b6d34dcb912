"""The model's own multi-token-prediction (MTP) head: read from its checkpoint, built from
mlx-lm's own block class, run by the last stage to draft the tokens after each one.

An MTP layer takes the main model's hidden state h at position i and the embedding
of the token at i + 1 and guesses the token at i + 2 (DeepSeek-V3's report, section
2.2; vLLM's ``deepseek_mtp.py``, ``mimo_mtp.py``, ``qwen3_next_mtp.py``,
``glm4_moe_mtp.py``, SGLang's ``deepseek_nextn.py``):

    z = out_norm(block(proj(concat(enorm(embed(t)), hnorm(h)))))    logits = head(z)

with the two normed halves in the family's order (MiMo puts the hidden state first),
``block`` one more decoder layer of the model's own kind, with a KV cache of its own,
and ``embed`` and ``head`` the model's own (DeepSeek's layer 61 carries copies of
both; like SGLang we use the model's). Which h: the state the model's final norm
gives (DeepSeek, GLM, Qwen3-Next, as vLLM feeds them), or the one it takes (MiMo,
whose vLLM model returns the state before its norm for its MTP). DeepSeek, GLM and
MiMo zero the embedding at position 0. Drafts beyond the first reuse the first layer
with its own ``z`` as the next hidden state (vLLM's chaining for k > 1); a checkpoint
with several MTP layers (MiMo) drafts with its first.

mlx-lm 0.32.2 drops these weights at load, so ``load_mtp`` reads them from the
folder itself (``mtp_layout.py`` names them) and passes them through the model's own
``sanitize`` as the layers of a one-layer model (FP8 dequantized, experts stacked,
DeepSeek's ``kv_b_proj`` split, Qwen3-Next's zero-centred norms shifted), so that
the block loads into mlx-lm's own class. ``without_mtp`` keeps them out of the main
model's load (its sanitize drops only DeepSeek's layer 61 by number).
"""

from __future__ import annotations

import dataclasses
import importlib
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import KVCache

from mlxpipe.shards.models import mtp_layout
from mlxpipe.shards.models.weights import tensor_files


@dataclass(frozen=True)
class Family:
    """How one mlx-lm model type's MTP layers are built and fed."""

    block: Callable  # (the mlx-lm module, the model's args, MTP layer i) -> a decoder block of the model's own class
    embed_first: bool = True   # the embedding's half of the concatenation comes first
    normed: bool = True        # h is the final norm's output (False: its input)
    zero_first: bool = False   # the embedding at position 0 is zeroed


# By mlx-lm model type (after its own remapping: Kimi K2 loads as deepseek_v3).
FAMILIES: Dict[str, Family] = {
    "deepseek_v3": Family(lambda m, a, i: m.DeepseekV3DecoderLayer(a, a.num_hidden_layers + i), zero_first=True),
    "glm4_moe": Family(lambda m, a, i: m.DecoderLayer(a, a.num_hidden_layers + i), zero_first=True),
    "mimo": Family(lambda m, a, i: m.TransformerBlock(a), embed_first=False, normed=False, zero_first=True),
    # full attention (not linear), a mixture of experts: the kind its MTP layer is
    "qwen3_next": Family(lambda m, a, i: m.Qwen3NextDecoderLayer(a, a.full_attention_interval - 1)),
    # the head ``mlxpipe bench mtp`` trains for the default model (``mtp`` names, a llama block)
    "llama": Family(lambda m, a, i: m.TransformerBlock(a)),
}


def model_type(model: nn.Module) -> str:
    """The mlx-lm model type whose code ``model`` runs."""
    return type(model).__module__.rsplit(".", 1)[-1]


def without_mtp(config: dict):
    """mlx-lm's ``get_model_classes`` for ``load_model``, with a ``sanitize`` that first drops the
    MTP head's tensors (wherever they sit: mlx-lm drops DeepSeek's only as layer 61)."""
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)
    if not mtp_layout.declared(config) and model_type_of(config) not in FAMILIES:
        return model_class, args_class
    layers = int(config.get("num_hidden_layers") or (config.get("text_config") or {}).get("num_hidden_layers") or 0)

    def sanitize(self, weights):
        weights = {k: v for k, v in weights.items() if mtp_layout.classify(k, layers) is None}
        return model_class.sanitize(self, weights) if hasattr(model_class, "sanitize") else weights

    return type(model_class.__name__, (model_class,), {"sanitize": sanitize, "__module__": model_class.__module__,
                                                       "mlx_lm_class": model_class}), args_class


def model_type_of(config: dict) -> str:
    return str(config.get("model_type", ""))


class MtpLayer(nn.Module):
    """One MTP layer: the norms, the projection, a decoder block, the output norm."""

    def __init__(self, block: nn.Module, dims: int, eps: float, embed_first: bool):
        super().__init__()
        self.enorm = nn.RMSNorm(dims, eps=eps)
        self.hnorm = nn.RMSNorm(dims, eps=eps)
        self.proj = nn.Linear(2 * dims, dims, bias=False)
        self.block = block
        self.out_norm = nn.RMSNorm(dims, eps=eps)
        self.embed_first = embed_first

    def __call__(self, e: mx.array, h: mx.array, cache) -> mx.array:
        a, b = self.enorm(e), self.hnorm(h)
        x = self.proj(mx.concatenate([a, b] if self.embed_first else [b, a], axis=-1))
        return self.out_norm(self.block(x, create_attention_mask(x, cache, return_array=True), cache))


class _Record:
    """What the model's final norm took and gave in each call since ``clear``."""

    def __init__(self, normed: bool):
        self.normed, self.calls = normed, []

    def clear(self) -> None:
        self.calls = []

    def hidden(self) -> List[mx.array]:
        """The hidden states the MTP head takes, one [rows, positions, D] array per call."""
        return [y if self.normed else x for x, y in self.calls]


def _tap(norm: nn.Module, record: _Record) -> None:
    """Make ``norm`` (the model's final norm) tell ``record`` what it took and gave."""
    base = type(norm)

    def call(self, x, *args, **kwargs):
        y = base.__call__(self, x, *args, **kwargs)
        record.calls.append((x, y))
        return y

    norm.__class__ = type(f"Tapped{base.__name__}", (base,), {"__call__": call})


class MtpHead:
    """A loaded MTP head (its first layer) with the model's embedding and output head, and a
    tap on the model's final norm for the hidden states it takes."""

    def __init__(self, layer: MtpLayer, family: Family, model: nn.Module, layers: int, layout: str):
        self.layer, self.family, self.layout = layer, family, layout
        self.layers_found = layers  # MTP layers in the checkpoint (only the first drafts)
        inner = _inner(model)
        self.embed = inner.embed_tokens
        self.head = model.lm_head if "lm_head" in model else inner.embed_tokens.as_linear
        self.record = _Record(family.normed)
        _tap(inner.norm, self.record)

    def make_cache(self) -> KVCache:
        return KVCache()

    def __call__(self, hidden: mx.array, tokens: List[int], start: int, cache) -> mx.array:
        """``z`` [1, n, D] at positions ``start`` .. ``start + n - 1`` from the main model's
        hidden states there [n, D] and the tokens that follow each; ``cache`` takes them."""
        e = self.embed(mx.array(tokens, dtype=mx.int32)[None])
        if self.family.zero_first and start == 0:
            e = e * (mx.arange(len(tokens)) > 0)[None, :, None].astype(e.dtype)
        return self.layer(e, hidden[None].astype(e.dtype), cache)

    def logits(self, z: mx.array) -> mx.array:
        return self.head(z)

    def parameters(self) -> dict:
        return self.layer.parameters()

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for _, a in tree_flatten(self.layer.parameters()))


def _inner(model: nn.Module) -> nn.Module:
    """The module that holds the model's embedding, blocks and final norm."""
    for _, m in model.named_modules():
        if isinstance(m, nn.Module) and "embed_tokens" in m and "norm" in m:
            return m
    raise ValueError(f"{type(model).__module__} keeps no embed_tokens and norm beside its blocks")


def _disguise(name: mtp_layout.Name) -> str:
    """A name under which the model's ``sanitize`` treats an MTP tensor as the only layer's own
    (norms as an ``input_layernorm``, so that a zero-centred one is shifted as the model's are)."""
    if name.role == "block":
        return f"model.layers.0.{name.rest}"
    if name.role == "proj":
        return f"model.layers.0.__mtp_proj.{name.rest}"
    return f"model.layers.0.__mtp_{name.role}.input_layernorm.{name.rest}"


def _undisguise(key: str) -> str:
    """The ``MtpLayer``'s own name of a sanitized tensor."""
    rest = key[len("model.layers.0."):]
    if rest.startswith("__mtp_"):
        role, tail = rest[len("__mtp_"):].split(".", 1)
        return f"{role}.{tail.replace('input_layernorm.', '', 1)}"
    return f"block.{rest}"


def _sanitized(model: nn.Module, tensors: Dict[mtp_layout.Name, mx.array]) -> Dict[str, mx.array]:
    """``tensors`` of one MTP layer through the model's own ``sanitize``, as one layer's, by the
    ``MtpLayer``'s names."""
    weights = {_disguise(n): v for n, v in tensors.items()}
    own = getattr(type(model), "mlx_lm_class", type(model))  # (not ``without_mtp``'s, which drops them)
    if hasattr(own, "sanitize"):
        one = types.SimpleNamespace(args=dataclasses.replace(model.args, num_hidden_layers=1))
        weights = own.sanitize(one, weights)
    return {_undisguise(k): v for k, v in weights.items() if k.startswith("model.layers.0.")}


def _quantize_as_stored(layer: MtpLayer, weights: Dict[str, mx.array]) -> None:
    """Quantized tensors (``scales``): the modules that have them become quantized ones first."""
    from mlx_lm.utils import infer_quant_config

    if any(k.endswith(".scales") for k in weights):
        nn.quantize(layer, class_predicate=lambda p, m: hasattr(m, "to_quantized") and f"{p}.scales" in weights
                    and infer_quant_config(p, m, weights))


def load_mtp(folder: Path, model: nn.Module, config: dict) -> Tuple[Optional[MtpHead], str]:
    """The MTP head of the checkpoint in ``folder`` for the loaded ``model`` (lazy: nothing is read
    until used), or None and why not, in one line."""
    text = config.get("text_config", config) if "num_hidden_layers" not in config else config
    num_layers = int(text["num_hidden_layers"])
    layout, names = mtp_layout.found(tensor_files(folder), num_layers)
    kind = model_type(model)
    if layout is None:
        why = "its checkpoint has no MTP weights" + (" (a conversion dropped them)" if mtp_layout.declared(text)
                                                     else "")
        return None, why
    family = FAMILIES.get(kind)
    if family is None:
        return None, f"its MTP layers ({kind}) are not supported here yet"
    layers = mtp_layout.layers_in(names, num_layers)
    wanted = {mtp_layout.classify(k, num_layers): k for k in names}
    first = {n: k for n, k in wanted.items() if n.role != "copy" and n.layer in (0, -1)}
    arrays: Dict[mtp_layout.Name, mx.array] = {}
    for file in sorted({names[k] for k in first.values()}):
        loaded = mx.load(str(folder / file))
        arrays.update({n: loaded[k] for n, k in first.items() if names[k] == file and k in loaded})
    try:
        block = family.block(importlib.import_module(type(model).__module__), model.args, 0)
        layer = MtpLayer(block, int(model.args.hidden_size), float(getattr(model.args, "rms_norm_eps", 1e-6)),
                         family.embed_first)
        weights = _sanitized(model, {dataclasses.replace(n, layer=0): v for n, v in arrays.items()})
        _quantize_as_stored(layer, weights)
        layer.load_weights(list(weights.items()), strict=True)
    except (ValueError, KeyError, AttributeError, TypeError) as err:
        return None, f"its MTP weights do not load as a {kind} layer: {err}"
    return MtpHead(layer, family, model, len(layers), layout), ""


def unit_tensors(head: MtpHead, num_layers: int) -> Dict[str, mx.array]:
    """The head's tensors under the checkpoint's names (as loaded: sanitized, maybe quantized):
    the ``mtp`` unit a node that lacks the model receives."""
    out = {}
    for key, value in tree_flatten(head.layer.parameters()):
        role, rest = key.split(".", 1)
        layer = -1 if head.layout == "mtp" and role != "block" else 0
        out[mtp_layout.checkpoint_name(head.layout, num_layers, mtp_layout.Name(layer, role, rest))] = value
    return out
