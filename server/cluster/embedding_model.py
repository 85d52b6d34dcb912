"""An embedding model the head runs itself (``--embedding-model``), beside the pipeline.

Loaded by its own library: mlx-embeddings for the architectures it ships (BERT,
XLM-RoBERTa, ModernBERT, Qwen3, Gemma 3, ...: its pooling and normalization, the
model's ``text_embeds``), else mlx-lm (any model it loads: the final hidden state,
pooled as the folder's sentence-transformers ``1_Pooling/config.json`` says, last
token when it says nothing, and normalized). ``default`` is all-MiniLM-L6-v2
(``shards/models/store.py``).

All MLX work runs on one thread of its own (as ``draft_model.py``'s), which
asyncio calls into: a request's inputs go in batches of similar length, padded
(the attention mask keeps padding out of every real position), at most
``BATCH_TOKENS`` positions a forward pass.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional, Sequence

import numpy as np

from mlxpipe.shards.models.store import (DEFAULT_EMBEDDING_NAME, DEFAULT_MODEL, ModelNotFound,
                                         pull_default_embedding, resolve_model)

logger = logging.getLogger(__name__)

BATCH_TOKENS = 8192  # positions (rows x padded length) in one forward pass, at most
MAX_ROWS = 64        # inputs in one forward pass, at most
POOLINGS = ("mean", "last", "cls")


class EmbeddingModelError(ValueError):
    """The embedding model cannot be loaded or served."""


@dataclass
class EmbeddingFacts:
    """What the API says of the model and checks requests against."""

    name: str                 # what /v1/models lists and requests name
    path: Path
    library: str              # "mlx-embeddings" or "mlx-lm"
    model_type: str
    dimensions: int           # of a vector, as the model makes it
    max_tokens: int           # tokens one input may hold (the model's own limit)
    vocab_size: int
    matryoshka: bool          # its card says it is trained for truncated vectors (``dimensions``)
    pooling: str              # "mean", "last" or "cls" (mlx-lm models; mlx-embeddings' is its own)
    weight_bytes: int


def _json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _pooling(path: Path) -> str:
    """The pooling a sentence-transformers folder names (``1_Pooling/config.json``); last token else."""
    pooling = next((_json(p / "config.json") for p in sorted(path.glob("*Pooling*")) if p.is_dir()), {})
    if pooling.get("pooling_mode_mean_tokens"):
        return "mean"
    if pooling.get("pooling_mode_cls_token"):
        return "cls"
    return "last"


def _max_tokens(path: Path, config: dict) -> int:
    """Tokens one input may hold: sentence-transformers' ``max_seq_length``, else the model's positions."""
    seq = _json(path / "sentence_bert_config.json").get("max_seq_length")
    positions = config.get("max_position_embeddings") or 8192
    return int(min(seq, positions) if seq else positions)


def _matryoshka(path: Path) -> bool:
    """Whether the model card says the model is trained for truncated vectors (Matryoshka
    representation learning): only then are ``dimensions`` served."""
    try:
        card = (path / "README.md").read_text(errors="replace")
    except OSError:
        return False
    return bool(re.search(r"matryoshka|\bMRL\b", card, re.IGNORECASE))


def _mlx_embeddings_knows(model_type: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(f"mlx_embeddings.models.{model_type}") is not None
    except ModuleNotFoundError:  # mlx-embeddings is not installed
        return False


class EmbeddingModel:
    """The loaded model and its thread; ``embed`` from the event loop."""

    def __init__(self, path: Path, name: str):
        self.path = path
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="embed")
        self.model = self.tokenizer = None
        self.closed = False
        self.inputs = self.tokens = 0  # embedded since start (/health)
        try:
            self.facts: EmbeddingFacts = self._pool.submit(self._load, name).result()
        except BaseException:
            self._pool.shutdown(wait=True)
            raise

    # -- in the worker thread -------------------------------------------------

    def _load(self, name: str) -> EmbeddingFacts:
        import mlx.core as mx
        from mlx.utils import tree_flatten

        config = _json(self.path / "config.json")
        model_type = config.get("model_type") or ""
        if _mlx_embeddings_knows(model_type):
            from mlx_embeddings import load as load_embeddings

            self.model, wrapper = load_embeddings(str(self.path))
            library, pooling = "mlx-embeddings", "mean" if model_type in ("bert", "xlm_roberta") else "last"
        else:
            from mlx_lm.utils import load as load_lm

            try:
                self.model, wrapper = load_lm(str(self.path))
            except Exception as err:  # noqa: BLE001 - any failure to load is the one message
                raise EmbeddingModelError(f"--embedding-model {self.path}: neither mlx-embeddings (model type "
                                          f"{model_type!r}) nor mlx-lm can load it: {err}") from None
            if not hasattr(self.model, "model"):
                raise EmbeddingModelError(f"--embedding-model {self.path}: mlx-lm's {model_type} has no inner "
                                          "model whose final hidden state could be pooled")
            library, pooling = "mlx-lm", _pooling(self.path)
        self.tokenizer = getattr(wrapper, "_tokenizer", wrapper)  # the Hugging Face tokenizer
        weights = sum(v.nbytes for _, v in tree_flatten(self.model.parameters()))
        self.library, self.pooling = library, pooling
        probe = self._forward([[1, 2, 3]])  # compiles the kernels now, not in the first request; the width
        mx.eval(probe)
        vocab = config.get("vocab_size") or len(self.tokenizer)
        return EmbeddingFacts(name=name, path=self.path, library=library, model_type=model_type,
                              dimensions=int(probe.shape[-1]), max_tokens=_max_tokens(self.path, config),
                              vocab_size=int(vocab), matryoshka=_matryoshka(self.path), pooling=pooling,
                              weight_bytes=int(weights))

    def _forward(self, batch: Sequence[Sequence[int]]):
        """Normalized vectors of inputs padded to one length (right padding, masked)."""
        import mlx.core as mx

        width = max(len(x) for x in batch)
        ids = mx.array([list(x) + [0] * (width - len(x)) for x in batch])
        mask = mx.array([[1] * len(x) + [0] * (width - len(x)) for x in batch])
        if self.library == "mlx-embeddings":
            return self.model(ids, attention_mask=mask).text_embeds
        hidden = self.model.model(ids).astype(mx.float32)  # causal: right padding never reaches a real position
        if self.pooling == "mean":
            m = mask[..., None].astype(mx.float32)
            pooled = (hidden * m).sum(axis=1) / mx.maximum(m.sum(axis=1), 1)
        elif self.pooling == "cls":
            pooled = hidden[:, 0]
        else:
            last = mx.array([len(x) - 1 for x in batch])
            pooled = mx.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0]
        return pooled / mx.maximum(mx.linalg.norm(pooled, axis=-1, keepdims=True), 1e-12)

    def _embed(self, inputs: List[List[int]]) -> np.ndarray:
        import mlx.core as mx

        out = np.zeros((len(inputs), self.facts.dimensions), dtype=np.float32)
        order = sorted(range(len(inputs)), key=lambda i: len(inputs[i]))
        start = 0
        while start < len(order):
            end = start + 1  # rows of similar length, within the positions a pass may hold
            while (end < len(order) and end - start < MAX_ROWS
                   and (end - start + 1) * len(inputs[order[end]]) <= BATCH_TOKENS):
                end += 1
            rows = order[start:end]
            vectors = self._forward([inputs[i] for i in rows]).astype(mx.float32)
            mx.eval(vectors)
            out[rows] = np.array(vectors)
            start = end
        return out

    # -- on the event loop ----------------------------------------------------

    def tokenize(self, texts: Sequence[str]) -> List[List[int]]:
        """Token ids of each text, with the model's special tokens (call in a worker thread)."""
        return [list(self.tokenizer.encode(t)) for t in texts]

    async def embed(self, inputs: List[List[int]], dimensions: Optional[int] = None) -> np.ndarray:
        """One normalized float32 vector per input (truncated to ``dimensions`` and normalized
        again: Matryoshka truncation), computed on the model's thread."""
        if self.closed:
            raise EmbeddingModelError("the server is shutting down")
        vectors = await asyncio.wrap_future(self._pool.submit(self._embed, inputs))
        self.inputs += len(inputs)
        self.tokens += sum(map(len, inputs))
        if dimensions is not None and dimensions < vectors.shape[1]:
            vectors = vectors[:, :dimensions]
            vectors = vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
        return vectors

    def as_dict(self) -> dict:
        f = self.facts
        return {"name": f.name, "library": f.library, "dimensions": f.dimensions, "max_tokens": f.max_tokens,
                "inputs": self.inputs, "tokens": self.tokens}

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._pool.submit(self._unload)
        self._pool.shutdown(wait=True)

    def _unload(self) -> None:
        import gc

        self.model = None
        gc.collect()


def load_embedding_model(name: Optional[str]) -> Optional[EmbeddingModel]:
    """``--embedding-model``: "default" (all-MiniLM-L6-v2), a folder or a Hugging Face repo id."""
    if not name:
        return None
    try:
        if name == DEFAULT_MODEL:
            return EmbeddingModel(pull_default_embedding(), DEFAULT_EMBEDDING_NAME)
        path = resolve_model(name)
    except ModelNotFound as err:
        raise EmbeddingModelError(f"--embedding-model: {err}") from None
    return EmbeddingModel(path, name if not Path(name).expanduser().exists() else path.name)
