"""A draft model for speculative decoding, run by the head (``--draft-model``).

A small model with the served model's tokenizer guesses the next tokens of a
sequence greedily; the pipeline verifies them as it verifies prompt lookup's
guesses (``core/speculation.py``), so output never depends on the draft: a poor one
only costs the positions that verify it.

The model runs in one worker thread of the head (MLX releases the GIL while it
computes, so the event loop keeps serving). A sequence's ``ModelDrafter`` never
makes the scheduler wait: ``propose`` answers with the drafts it has ready and,
when it has too few, queues a job that extends them and wakes the engine when
done. Meanwhile the sequence decodes in its group as usual. Each sequence keeps
its own KV cache of the draft model, trimmed back to the tokens it shares with
the sequence (mlx-lm's trimmable caches) when a draft was rejected.
"""

from __future__ import annotations

import gc
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable, List, Optional, Sequence, Set

import mlx.core as mx
from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache
from mlx_lm.utils import load

from mlxpipe.shards.models.store import ModelNotFound, resolve_model

logger = logging.getLogger(__name__)


class DraftModelError(ValueError):
    """The draft model cannot serve as this model's draft."""


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


class DraftModel:
    """The loaded draft model and the one thread that runs it, shared by every sequence.

    ``window``: prompt tokens a sequence's draft cache starts with, at most (the
    latest ones): a long prompt costs the draft a bounded prefill. ``ahead``:
    tokens one job drafts, at most.
    """

    def __init__(self, path: Path, tokenizer, window: int = 1024, ahead: int = 4):
        self.path, self.window, self.ahead = path, window, ahead
        self.jobs = 0              # jobs run, and tokens drafted (for /health)
        self.drafted = 0
        self.model = None
        self._wake: Callable[[], None] = lambda: None
        self._loop = None
        self.closed = False
        self.live: Set["ModelDrafter"] = set()  # drafters holding a draft cache (the worker's)
        # Every MLX call of the draft model, its loading included, runs in this one
        # thread (arrays of a thread MLX no longer serves abort the process at exit).
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="draft")
        try:
            self._pool.submit(self._load, tokenizer).result()
        except BaseException:
            self._pool.shutdown(wait=True)
            raise

    def _load(self, tokenizer) -> None:
        model, draft_tokenizer = load(str(self.path))
        if draft_tokenizer.get_vocab() != tokenizer.get_vocab():
            raise DraftModelError(f"the draft model {self.path} has another tokenizer than the served model: "
                                  "its guesses would be other tokens")
        self.model = model
        warm = ModelDrafter(self)
        warm._draft([0, 0, 0], 2)  # MLX compiles its CPU kernels on first use: not mid-request
        warm._drop()
        self.jobs = self.drafted = 0

    def bind(self, loop, wake: Callable[[], None]) -> None:
        """Drafts finish in the worker thread; ``wake`` is then called on ``loop``."""
        self._loop, self._wake = loop, wake

    def drafter(self) -> "ModelDrafter":
        return ModelDrafter(self)

    def close(self) -> None:
        # Waits for the jobs queued now (short drafts): MLX must not be computing in
        # a thread while the process exits. The weights go in that thread too.
        if self.closed:
            return
        self.closed = True
        self._pool.submit(self._unload)
        self._pool.shutdown(wait=True)

    def _unload(self) -> None:
        for drafter in list(self.live):
            drafter._drop()
        self.model = None
        gc.collect()

    def _submit(self, fn, *args) -> Optional[Future]:
        return None if self.closed else self._pool.submit(fn, *args)

    def _done(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` on the event loop (from the worker thread), then wake the engine."""
        def run():
            callback()
            self._wake()

        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(run)

    def weight_bytes(self) -> int:
        """What its weights hold in the head's memory."""
        from mlx.utils import tree_flatten

        return sum(v.nbytes for _, v in tree_flatten(self.model.parameters())) if self.model is not None else 0

    def as_dict(self) -> dict:
        return {"path": str(self.path), "jobs": self.jobs, "drafted_tokens": self.drafted}


class ModelDrafter:
    """One sequence's drafts from the draft model.

    On the event loop: ``out``, the sequence's tokens as the draft model last saw
    them followed by the tokens it drafted after them; ``busy`` while a job runs.
    In the worker thread only: the draft KV cache and ``_held``, the tokens it holds.
    """

    def __init__(self, owner: DraftModel):
        self.owner = owner
        self.out: List[int] = []
        self.busy = False
        self.fresh = False   # ``out`` came from a job not yet looked at
        self.misses = 0      # jobs in a row whose drafts no longer followed the sequence when looked at
        self.pause = 0       # proposes to let pass without a job (a draft slower than the pipeline)
        self.closed = False
        self.failed = False
        self._cache = None
        self._held: List[int] = []
        self._base = 0  # tokens before the window: never in the cache

    # -- on the event loop ----------------------------------------------------

    def prepare(self, tokens: Sequence[int]) -> None:
        self._start(list(tokens), 1)  # prefill the draft cache while the pipeline prefills

    def propose(self, tokens: Sequence[int], k: int, confirmed: int) -> List[int]:
        n, out = len(tokens), self.out
        ready = out[n : n + k] if len(out) > n and out[n - 1] == tokens[-1] and out[:n] == list(tokens) else []
        if self.fresh:  # a draft that is never ahead of the sequence only costs the head's CPU: back off
            self.fresh = False
            self.misses = 0 if ready else self.misses + 1
            if self.misses >= 3:
                self.pause = 2 ** min(self.misses, 8)
        if self.pause:
            self.pause -= 1
        elif not self.busy and len(ready) < max(k, self.owner.ahead):
            # Extend the drafts that still follow the sequence, or draft afresh after it.
            self._start(out if ready else list(tokens), self.owner.ahead)
        return ready

    def close(self) -> None:
        self.closed = True
        self.owner._submit(self._drop)  # (after a job still running: the cache is the worker's)

    def _start(self, tokens: List[int], k: int) -> None:
        if self.busy or self.closed or self.failed or not tokens:
            return
        future = self.owner._submit(self._draft, tokens, k)
        if future is None:  # the server is stopping
            return
        self.busy = True
        future.add_done_callback(lambda f: self.owner._done(lambda: self._finished(f)))

    def _finished(self, future: Future) -> None:
        self.busy = False
        if future.cancelled():
            return
        err = future.exception()
        if err is not None:
            self.failed = True  # the sequence goes on without drafts
            logger.error("the draft model failed; this sequence is no longer drafted", exc_info=err)
        elif not self.closed:
            self.out, self.fresh = future.result(), True

    # -- in the worker thread -------------------------------------------------

    def _drop(self) -> None:
        self._cache = None
        self.owner.live.discard(self)

    def _draft(self, tokens: List[int], k: int) -> List[int]:
        """``tokens`` and the ``k`` tokens the draft model takes to follow them, greedily."""
        model = self.owner.model
        keep = _common_prefix(self._held, tokens)
        if keep == len(tokens):  # logits for the last token are needed again
            keep -= 1
        if self._cache is None or keep < self._base or (keep < len(self._held)
                                                          and not can_trim_prompt_cache(self._cache)):
            self._cache = make_prompt_cache(model)
            self.owner.live.add(self)
            self._base = max(0, min(len(tokens) - 1, len(tokens) - self.owner.window))
            self._held, keep = list(tokens[: self._base]), self._base
        elif keep < len(self._held):
            trim_prompt_cache(self._cache, len(self._held) - keep)
            del self._held[keep:]
        todo = tokens[keep:]
        # All but the last token only fill the cache: their logits (the head over the
        # whole vocabulary, per position) are never computed, as in mlx-lm's prefill.
        for i in range(0, len(todo) - 1, 512):
            model(mx.array(todo[i : min(i + 512, len(todo) - 1)])[None], cache=self._cache)
            mx.eval([c.state for c in self._cache])
        logits = model(mx.array(todo[-1:])[None], cache=self._cache)
        self._held += todo
        drafted: List[int] = []
        while True:
            token = int(mx.argmax(logits[0, -1]).item())
            drafted.append(token)
            if len(drafted) == k:
                break
            logits = model(mx.array([[token]]), cache=self._cache)
            self._held.append(token)
        self.owner.jobs += 1
        self.owner.drafted += len(drafted)
        return tokens + drafted


def load_draft_model(name: Optional[str], tokenizer) -> Optional[DraftModel]:
    """``--draft-model``: a folder, a cached or downloadable HF repo id, or "default"."""
    if not name:
        return None
    try:
        path = resolve_model(name)
    except ModelNotFound as err:
        raise DraftModelError(f"--draft-model: {err}") from None
    return DraftModel(path, tokenizer)
