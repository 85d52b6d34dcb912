"""A model's tokenizer as ``tokenizer.json`` text: what llguidance builds its tokenizer
from, on the head (``server/api/structured.py``) and, sent in the last stage's
``Load``, on the stage (``grammar.tokenizer_from_json``)."""

from __future__ import annotations

import copy


def tokenizer_json(tokenizer) -> str:
    """The ``tokenizer.json`` of an mlx-lm ``TokenizerWrapper`` (as llguidance takes it:
    no padding, no truncation)."""
    backend = copy.copy(tokenizer._tokenizer.backend_tokenizer)
    backend.no_padding()
    backend.no_truncation()
    return backend.to_str()
