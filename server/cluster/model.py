"""The model a head serves: where it is, its config, its tokenizer, how it is quantized.

Resolved (``shards/models/store.py``: a folder, a Hugging Face repo id, or the embedded
default) and checked against the options before anything starts: a quantized
model given ``--bits``, ``--bits auto`` without the planner, a ``--split`` that
does not fit the model are refused at once.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from mlx_lm.utils import load_config, load_tokenizer
from transformers.tokenization_utils_base import VERY_LARGE_INTEGER

from mlxpipe.proto import pipeline_pb2 as pb
from mlxpipe.server.cluster.groups import widths_of
from mlxpipe.server.cluster.splits import fixed_ranges
from mlxpipe.server.config import ClusterConfig
from mlxpipe.shards.models.cuts import Cuts, of_config
from mlxpipe.shards.models.layers import with_sizes
from mlxpipe.shards.models.store import resolve_model, text_config
from mlxpipe.shards.models.tokenizer_json import tokenizer_json
from mlxpipe.shards.models.vision import has_tower, mlx_vlm_installed, takes_images
from mlxpipe.shards.params.quant import QuantSpec


def read_config(path: Path) -> dict:
    """mlx-lm's reading of the config (generation_config.json's eos_token_id wins); for a
    multimodal model its text part, with the model type and end-of-sequence ids of the whole."""
    config = load_config(path)
    text = with_sizes(text_config(config)) | {"model_type": config.get("model_type")}
    if "eos_token_id" in config:
        text["eos_token_id"] = config["eos_token_id"]
    return text


@dataclass
class Model:
    path: Path
    config: dict
    tokenizer: object                  # mlx-lm's TokenizerWrapper
    quant: Optional[QuantSpec] = None  # how stages quantize it as they load it (None: as stored, or --bits auto)

    @property
    def vocab_size(self) -> int:
        return int(self.config.get("vocab_size", 0)) or len(self.tokenizer)

    @property
    def num_layers(self) -> int:
        return int(self.config["num_hidden_layers"])

    @property
    def max_positions(self) -> int:
        """The model's own context (as a stage reads it: ``max_position_embeddings``, else 2**20)."""
        return int(self.config.get("max_position_embeddings") or 1 << 20)

    @property
    def weight_bytes(self) -> int:
        return sum(f.stat().st_size for f in self.path.glob("*.safetensors"))

    @functools.cached_property
    def cuts(self) -> Cuts:
        """Where the model can be cut into stages (its structure, traced without weights)."""
        return of_config(load_config(self.path), self.num_layers)

    @functools.cached_property
    def vision(self) -> bool:
        """Whether it is served as a vision-language model (``shards/models/vision.py``)."""
        return takes_images(self.path)

    @functools.cached_property
    def tower_note(self) -> str:
        """Why a model with a vision tower takes no images here (empty: it does, or has none)."""
        if self.vision or not has_tower(load_config(self.path)):
            return ""
        if not mlx_vlm_installed():
            return (f"{self.path.name} has a vision tower; images need mlx-vlm: pip install 'mlxpipe[vision]' "
                    "(served as text only)")
        return f"{self.path.name}: mlx-vlm cannot serve its images (no tower weights, or an unknown type): text only"

    @functools.cached_property
    def tokenizer_spec(self) -> pb.TokenizerSpec:
        """The tokenizer as the last stage needs it for grammars."""
        return pb.TokenizerSpec(json=tokenizer_json(self.tokenizer), eos_token_ids=sorted(self.tokenizer.eos_token_ids))


def open_model(cfg: ClusterConfig) -> Model:
    """Resolve ``cfg.model``, read its config and tokenizer, and refuse options that
    cannot apply to it (before any stage starts)."""
    path = resolve_model(cfg.model)
    config = read_config(path)
    tokenizer = load_tokenizer(path, eos_token_ids=config.get("eos_token_id"))
    # The API refuses a prompt longer than the context itself (a 400 that says so): transformers'
    # warning that a long one "will result in indexing errors" would only mislead, so it is off.
    tokenizer._tokenizer.model_max_length = VERY_LARGE_INTEGER
    model = Model(path, config, tokenizer)
    if cfg.bits is not None:
        if "quantization" in config:
            raise ValueError(f"{path} is quantized already; --bits quantizes a full-precision "
                             "model (bf16, fp16, fp32, or DeepSeek's FP8) as the stages load it")
        if cfg.bits == "auto" and cfg.split not in (None, "auto"):
            raise ValueError("--bits auto needs --split auto: the planner chooses the bits")
        if cfg.bits != "auto":
            model.quant = QuantSpec.parse(cfg.bits, cfg.group_size)
    remote = bool(cfg.nodes or cfg.join_listen or cfg.discover)
    if cfg.tp == [0] and (not remote or cfg.split not in (None, "auto")):
        raise ValueError("--tp auto groups remote nodes from their measured links: give --nodes (and --split auto); "
                         "on one machine give the ranks per stage, --tp 2 or 2,1")
    if cfg.tp and cfg.tp != [0] and remote:
        raise ValueError("--tp gives local stages' ranks; with --nodes, name a stage's group as a+b (or --tp auto)")
    if not remote:
        widths_of(cfg.stages, cfg.tp)  # (ValueError: one line, before any stage starts)
    if cfg.split not in (None, "auto"):
        # (nodes that join are not known yet: then the split need only fit the model)
        named = len(cfg.split.split(",")) if cfg.join_listen or cfg.discover else len(cfg.nodes) or cfg.stages
        fixed_ranges(model.num_layers, named, cfg.split, model.cuts, quiet=True)
    return model
