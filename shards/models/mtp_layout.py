"""Where a checkpoint keeps its multi-token-prediction (MTP) head, by name. Pure Python.

Checkpoints that ship MTP heads name them in one of three layouts (vLLM's
``deepseek_mtp.py``, ``glm4_moe_mtp.py``, ``mimo_mtp.py`` and ``qwen3_next_mtp.py``
read the same names):

- ``layers``: one more decoder layer after the model's own, ``model.layers.{L + i}.``
  (DeepSeek-V3, V3.1, V3.2, Kimi K2: layer 61; GLM-4.5: layer 92), its block's
  tensors beside ``enorm``, ``hnorm``, ``eh_proj``, ``shared_head.norm``, and copies of
  the embedding (``embed_tokens``) and the output head (``shared_head.head``), which
  are the model's own again and are never loaded;
- ``mtp_layers``: ``model.mtp_layers.{i}.`` (MiMo: two), the block's tensors beside
  ``token_layernorm``, ``hidden_layernorm``, ``input_proj``, ``final_layernorm``;
- ``mtp``: ``mtp.layers.{i}.`` blocks and, shared by them, ``mtp.fc``,
  ``mtp.pre_fc_norm_embedding``, ``mtp.pre_fc_norm_hidden``, ``mtp.norm`` (Qwen3-Next,
  Qwen3.5; and the head ``mlxpipe bench mtp`` trains for a llama).

mlx-lm 0.32.2 drops all of these at load (its ``sanitize``), so a stage reads them
itself (``mtp.py``). This module only names them: which unit a tensor travels
in (``weights.py``), what the planner counts (``server/cluster/cost.py``), which
tensors the main model must not see. The roles of a layer's own tensors:
``enorm`` (the embedding's norm), ``hnorm`` (the hidden state's), ``proj`` (the
projection of the two, concatenated), ``out_norm`` (the norm before the output
head).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Tuple

ROLES = ("enorm", "hnorm", "proj", "out_norm")

# Each layout's names for a layer's own tensors (relative to the layer; ``mtp``: to ``mtp.``).
_EXTRAS = {
    "layers": {"enorm": "enorm", "hnorm": "hnorm", "proj": "eh_proj", "out_norm": "shared_head.norm"},
    "mtp_layers": {"enorm": "token_layernorm", "hnorm": "hidden_layernorm", "proj": "input_proj",
                   "out_norm": "final_layernorm"},
    "mtp": {"enorm": "pre_fc_norm_embedding", "hnorm": "pre_fc_norm_hidden", "proj": "fc", "out_norm": "norm"},
}
_COPIES = ("embed_tokens.", "shared_head.head.")  # the model's own embedding and head again (``layers``)
_LAYERS_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_MTP_LAYERS_RE = re.compile(r"^model\.mtp_layers\.(\d+)\.(.+)$")
_MTP_RE = re.compile(r"^mtp\.(?:layers\.(\d+)\.)?(.+)$")


@dataclass(frozen=True)
class Name:
    """What one checkpoint tensor of the MTP head is."""

    layer: int       # the MTP layer (0, 1, ...); -1: shared by all of them (``mtp.fc``, ...)
    role: str        # "block" (the decoder block's own), one of ``ROLES``, or "copy" (never loaded)
    rest: str        # the name inside the block, or the role's parameter (``weight``, ``weight_scale_inv``, ...)


def classify(name: str, num_layers: int) -> Optional[Name]:
    """What ``name`` is in the MTP head of a model of ``num_layers`` layers (None: not part of it)."""
    m = _LAYERS_RE.match(name)
    if m and int(m.group(1)) >= num_layers:
        return _in_layer("layers", int(m.group(1)) - num_layers, m.group(2))
    m = _MTP_LAYERS_RE.match(name)
    if m:
        return _in_layer("mtp_layers", int(m.group(1)), m.group(2))
    m = _MTP_RE.match(name)
    if m:
        if m.group(1) is not None:
            return Name(int(m.group(1)), "block", m.group(2))
        for role, own in _EXTRAS["mtp"].items():
            if m.group(2).startswith(own + "."):
                return Name(-1, role, m.group(2)[len(own) + 1:])
        return Name(-1, "copy", m.group(2))  # something of the head's we do not use
    return None


def _in_layer(layout: str, layer: int, rest: str) -> Name:
    if rest.startswith(_COPIES):
        return Name(layer, "copy", rest)
    for role, own in _EXTRAS[layout].items():
        if rest.startswith(own + "."):
            return Name(layer, role, rest[len(own) + 1:])
    return Name(layer, "block", rest)


def layout_of(name: str, num_layers: int) -> Optional[str]:
    """Which layout an MTP tensor's name is in."""
    if _LAYERS_RE.match(name) and int(_LAYERS_RE.match(name).group(1)) >= num_layers:
        return "layers"
    if _MTP_LAYERS_RE.match(name):
        return "mtp_layers"
    return "mtp" if _MTP_RE.match(name) else None


def checkpoint_name(layout: str, num_layers: int, name: Name) -> str:
    """The checkpoint's name of a tensor (the inverse of ``classify``)."""
    if layout == "mtp":
        if name.role == "block":
            return f"mtp.layers.{name.layer}.{name.rest}"
        return f"mtp.{_EXTRAS['mtp'][name.role]}.{name.rest}"
    prefix = f"model.layers.{num_layers + name.layer}." if layout == "layers" else \
        f"model.mtp_layers.{name.layer}."
    if name.role == "block":
        return prefix + name.rest
    return f"{prefix}{_EXTRAS[layout][name.role]}.{name.rest}"


def declared(config: dict) -> bool:
    """Whether a config says its model has MTP layers (its checkpoint may still lack them)."""
    return any(int(config.get(k) or 0) > 0 for k in ("num_nextn_predict_layers", "mtp_num_hidden_layers"))


def found(tensors: Dict[str, str], num_layers: int) -> Tuple[Optional[str], Dict[str, str]]:
    """Of a folder's ``tensors`` (name -> file: ``weights.tensor_files``), the MTP head's, and
    their layout (None: none, or names in more than one layout)."""
    names = {k: f for k, f in tensors.items() if classify(k, num_layers) is not None}
    layouts = {layout_of(k, num_layers) for k in names}
    if len(layouts) != 1:
        return None, {}
    return layouts.pop(), names


def layers_in(names: Iterable[str], num_layers: int) -> List[int]:
    """The MTP layers (0, 1, ...) that have block tensors among ``names``."""
    return sorted({n.layer for k in names if (n := classify(k, num_layers)) is not None and n.role == "block"})
