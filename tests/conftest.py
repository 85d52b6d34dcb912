"""Shared fixtures: the embedded default model, a tiny DeepSeek-V3, mlx-lm references."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

PROMPTS = [
    "Why is the sky blue?",
    "Write a short poem about the sea and the mountains.",
    "List three prime numbers and explain what makes a number prime.",
]


@pytest.fixture(scope="session")
def default_model() -> Path:
    from mlxpipe.shards.store import pull_default

    return pull_default(progress=False)


@pytest.fixture(scope="session")
def dsv3_model(tmp_path_factory, default_model) -> Path:
    from tiny_models import build_deepseek_v3

    return build_deepseek_v3(tmp_path_factory.mktemp("dsv3") / "model", default_model)


@pytest.fixture(scope="session")
def reference():
    """reference(path, prompt_ids, n) -> greedy tokens of single-process mlx-lm,
    up to and including the first end-of-sequence token."""
    cache = {}
    models = {}

    def run(path: Path, prompt, n: int):
        import mlx.core as mx
        from mlx_lm import load
        from mlx_lm.generate import generate_step

        key = (str(path), tuple(prompt), n)
        if key not in cache:
            if str(path) not in models:
                models[str(path)] = load(str(path))
            model, tok = models[str(path)]
            tokens = []
            for token, _ in generate_step(mx.array(prompt), model, max_tokens=n):
                tokens.append(token)
                if token in tok.eos_token_ids:
                    break
            cache[key] = tokens
        return cache[key]

    return run


def run_async(coro, timeout: float = 300):
    """Run a coroutine to completion with a deadline (tests must never hang)."""
    return asyncio.run(asyncio.wait_for(coro, timeout))
