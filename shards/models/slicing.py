"""One stage's slice of an mlx-lm model: layers [start, end), run by the model's own code.

Any mlx-lm model whose blocks sit in a ``layers`` list and pass each other only
the hidden state can be cut. Rather than re-implementing each architecture's
forward pass, a stage calls the model's own ``__call__`` with the blocks it does
not hold swapped for stand-ins:

- blocks before ``start`` pass their input through untouched (``_Skip``);
- block ``start`` on a later stage ignores its input and runs on the
  activations received from the previous stage (``_Enter``);
- block ``end`` raises ``_Leave`` with the activations, so nothing after the
  range (final norm, output head) is built on an earlier stage.

A stand-in keeps what the model's code may read of the block it replaces (plain
attributes such as ``use_sliding``, and those of its sub-modules, as in
``layer.self_attn.is_local``) but none of its weights. Everything the model does
around its blocks (masks, positions, embedding scale, final norm, head)
therefore stays the model's own. MLX is lazy, so the embedding lookup that a
later stage's forward builds from its tokens is never evaluated unless used,
and weights are read from disk only when a computation uses them: a stage
materializes exactly the tensors its range needs.

Caches: ``make_cache()`` gives the model's cache slots, which need not be one per
block (Nemotron-H gives none to its MLP blocks; a looped model gives a block
two). Which block uses which slot is learned once, from one lazy forward with
every block swapped for a recorder. A stage keeps the slots of its own blocks;
every other slot is a stand-in: one of its own caches with the same
``caches.signature`` (so a model that builds its attention mask or reads its
positions from ``cache[i]`` sees the right offset), or, when it holds none of
that kind, an empty cache of the kind whose offsets say where each sequence is
(``caches.phantom``).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple, Union

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.cache import KVCache

from mlxpipe.shards.cache import kinds
from mlxpipe.shards.models.layers import layer_list, with_sizes
from mlxpipe.shards.models.quantize import QuantizeError, quantize_range

if TYPE_CHECKING:
    from mlxpipe.shards.params.quant import QuantSpec

logger = logging.getLogger(__name__)

# Model types that cannot be cut by layer, and why: a stage refuses any range of them
# but the whole model (a clear error at Load, never wrong tokens). What they share:
# their blocks hand each other more than the hidden state.
UNSUPPORTED: Dict[str, str] = {
    "afm7": "its last num_kv_reuse_layers blocks sit outside its `layers` list and reuse the keys and values "
            "of earlier blocks",
    "deepseek_v41": "its blocks pass several residual streams and a mixing state (hyper-connections) from "
                    "one to the next, not one hidden state",
    "gemma3n": "its hidden state is a stack of AltUp streams, and later blocks read the keys and values of "
               "earlier ones",
    "iquestloopcoder": "it runs its blocks' parts twice over, the second pass reading the first pass's keys "
                       "and values",
    "kimi_k3": "its blocks hand the next one attention-residual state besides the hidden state",
    "muse_spark": "its blocks hand the next one their attention input besides the hidden state",
}


class Unsupported(ValueError):
    """A model, or a range of it, that this stage cannot run; the message says why."""


class _Leave(Exception):
    def __init__(self, hidden: mx.array):
        super().__init__()
        self.hidden = hidden


def _shell(module: nn.Module, depth: int = 2) -> nn.Module:
    """A weightless module with ``module``'s plain attributes, and shells of its sub-modules."""
    shell = nn.Module()
    _copy_plain(shell, module, depth)
    return shell


def _copy_plain(stand_in: nn.Module, block: nn.Module, depth: int) -> None:
    stand_in.__dict__.update({k: v for k, v in block.__dict__.items() if not k.startswith("_")})
    if depth:
        for k, v in block.items():
            if isinstance(v, nn.Module):  # one without weights (a rotary embedding) is kept: the model may call it
                stand_in[k] = v if not tree_flatten(v.parameters()) else _shell(v, depth - 1)


_CLASSES: Dict[tuple, type] = {}


def _mimic(kind: type, block: nn.Module, *args) -> nn.Module:
    """A stand-in of ``kind`` for ``block``: of a class made from both (so the block's
    properties, such as ``is_sliding``, and ``isinstance`` answer as the block's do),
    with the block's plain attributes and shells of its sub-modules (``use_sliding``,
    ``self_attn.is_local``), but none of its weights."""
    key = (kind, type(block))
    if key not in _CLASSES:
        _CLASSES[key] = type(f"{kind.__name__.strip('_')}{type(block).__name__}", (kind, type(block)), {})
    stand_in = _CLASSES[key].__new__(_CLASSES[key])
    nn.Module.__init__(stand_in)
    _copy_plain(stand_in, block, depth=2)
    stand_in.setup(*args)
    return stand_in


Slot = Union[int, str]  # where a block's call carries the hidden state: a position, or a keyword


def _hidden(args: tuple, kwargs: dict, slot: Slot):
    return args[slot] if isinstance(slot, int) else kwargs[slot]


def _with_hidden(args: tuple, kwargs: dict, slot: Slot, hidden) -> Tuple[tuple, dict]:
    if isinstance(slot, int):
        return args[:slot] + (hidden,) + args[slot + 1:], kwargs
    return args, dict(kwargs, **{slot: hidden})


class _StandIn(nn.Module):
    def setup(self, hidden: Slot = 0, returns: int = 1) -> None:
        self._slot, self._returns = hidden, returns

    def _out(self, x):
        return x if self._returns == 1 else (x, *([None] * (self._returns - 1)))


class _Skip(_StandIn):
    """A block another stage holds (returning as many values as the model's blocks do)."""

    def __call__(self, *args, **kwargs):
        return self._out(_hidden(args, kwargs, self._slot))


class _Exit(_StandIn):
    """The first block after the range: hands the activations out of the forward."""

    def __call__(self, *args, **kwargs):
        raise _Leave(_hidden(args, kwargs, self._slot))


class _Inbox:
    hidden: Optional[mx.array] = None


class _Enter(_StandIn):
    """A block of the range, run on the received activations (the first of a later stage; else ``inbox``
    None) and, with ``finish`` (the last, where no head follows), handing its output out."""

    def setup(self, block: nn.Module, inbox: Optional[_Inbox], hidden: Slot = 0, finish: bool = False) -> None:
        self.block, self._inbox, self._slot, self._finish = block, inbox, hidden, finish

    def __call__(self, *args, **kwargs):
        if self._inbox is not None:
            args, kwargs = _with_hidden(args, kwargs, self._slot, self._inbox.hidden)
        out = self.block(*args, **kwargs)
        if self._finish:
            raise _Leave(out[0] if isinstance(out, tuple) else out)
        return out


@dataclass
class Trace:
    """What one lazy forward with every block swapped for a recorder shows of a model."""

    slots: List[List[int]]    # per block: the cache slots (indices into make_cache()) the model hands it
    returns: int = 1          # values a block returns (the hidden state, and what the loop hands on)
    reads: Dict[int, set] = field(default_factory=dict)  # block -> earlier blocks whose extra values it gets
    hidden: Slot = 0          # where a block's call carries the hidden state (the previous block's output)
    last: Any = None          # the previous recorder's output


class _Returned:
    """An extra value a recorder returns, tagged with its block."""

    def __init__(self, block: int):
        self.block = block


class _Recorder(_StandIn):
    """Stands in for block ``index`` in the forward that traces the model."""

    def setup(self, index: int, template: list, trace: Trace) -> None:
        self._index, self._template, self._trace = index, template, trace

    def __call__(self, *args, **kwargs):
        trace = self._trace
        if trace.last is None and not args:  # called by keyword: the first array it gets, until known
            trace.hidden = next(k for k, v in kwargs.items() if isinstance(v, mx.array))
        for slot, value in [*enumerate(args), *kwargs.items()]:
            if trace.last is not None and value is trace.last:
                trace.hidden = slot  # the previous block's output comes back here
            for k, c in enumerate(self._template):
                if value is c and k not in trace.slots[self._index]:
                    trace.slots[self._index].append(k)
            for v in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(v, _Returned):
                    trace.reads.setdefault(self._index, set()).add(v.block)
        trace.last = mx.array(_hidden(args, kwargs, trace.hidden))  # a new object, to be recognized
        if trace.returns == 1:
            return trace.last
        return (trace.last, *(_Returned(self._index) for _ in range(trace.returns - 1)))


def trace_blocks(model: nn.Module, blocks: List[nn.Module], template: list) -> Trace:
    """Which cache slots each block gets, how many values blocks return and which blocks
    read what others returned besides the hidden state: learned from one lazy forward
    with every block swapped for a recorder (nothing is evaluated, so no weight is
    read; a loop that unpacks more values than a recorder returned says how many).
    Slots no block gets are the model's own (an n-gram history the embedding keeps):
    every stage runs that code, and keeps them."""
    n = len(blocks)
    real = list(blocks)
    for returns in range(1, 5):
        trace = Trace([[] for _ in range(n)], returns)
        try:
            blocks[:] = [_mimic(_Recorder, b, i, template, trace) for i, b in enumerate(real)]
            model(mx.zeros((1, 1), dtype=mx.int32), cache=template)
        except Exception as err:  # noqa: BLE001 - the model's own code, run on stand-ins
            more = re.search(r"not enough values to unpack \(expected (\d+)", str(err))
            if more and int(more.group(1)) > returns:
                continue
            logger.info("could not trace %s (%s: %s)", type(model).__module__, type(err).__name__, err)
            break
        finally:
            blocks[:] = real
        if any(trace.slots) or not template:
            return trace
        break
    if len(template) == n:  # one per block, in order
        return Trace([[i] for i in range(n)])
    raise Unsupported(f"{type(model).__module__}: cannot tell which of its {len(template)} caches each of its "
                      f"{n} blocks uses")


def crossing(trace: Trace, c: int) -> Optional[str]:
    """Why a stage boundary at ``c`` would cut what blocks hand each other besides the hidden
    state (a value a block returns, a shared cache), as ``trace`` shows; None where it cuts
    nothing (``cuts.py`` lists a model's valid cuts)."""
    for j, read in sorted(trace.reads.items()):
        before = sorted(i for i in read if i < c)
        if j >= c and before:
            return f"block {j} reads what block {before[0]} returns besides the hidden state"
    owners: Dict[int, List[int]] = {}
    for i, slots in enumerate(trace.slots):
        for k in slots:
            owners.setdefault(k, []).append(i)
    for k, blocks in sorted(owners.items()):
        if min(blocks) < c <= max(blocks):
            return f"block {max(blocks)} shares its cache with block {min(blocks)}"
    return None


def _refuse_reads(model: nn.Module, trace: Trace, start: int, end: int) -> None:
    """Nothing but the hidden state crosses stages: a range whose ends cut what blocks hand
    each other besides it (values a block returns, a shared cache) cannot run here
    (``cuts.py`` names the cuts that can)."""
    for c in (start, end):
        why = crossing(trace, c) if 0 < c < len(trace.slots) else None
        if why is not None:
            raise Unsupported(f"layers [{start}, {end}) of {type(model).__module__} cannot run as a stage: {why}, "
                              "and that block is on another stage; cut the model elsewhere")


_LAUNCHING: Dict[type, type] = {}  # a block class -> its launching subclass


def _launch_call(self, *args, **kwargs):
    out = type(self).launched_from.__call__(self, *args, **kwargs)
    mx.async_eval([x for x in (out if isinstance(out, tuple) else (out,)) if isinstance(x, mx.array)])
    return out


def _launching(block: nn.Module) -> None:
    """Make ``block`` hand its output to MLX (``mx.async_eval``) as soon as its graph is
    built, so that MLX runs it while this thread builds the next block's (its class
    becomes a subclass that does; its weights, attributes and names stay)."""
    cls = type(block)
    if getattr(cls, "launched_from", None) is None:
        if cls not in _LAUNCHING:
            _LAUNCHING[cls] = type(f"Launching{cls.__name__}", (cls,), {"__call__": _launch_call,
                                                                          "launched_from": cls})
        block.__class__ = _LAUNCHING[cls]


class SlicedModel:
    """Layers ``[start, end)`` of ``model``; the first stage also embeds, the last
    also runs the final norm and output head (returning logits)."""

    def __init__(self, model: nn.Module, start: int, end: int):
        blocks = layer_list(model)
        n = len(blocks)
        if not (0 <= start < end <= n):
            raise ValueError(f"layer range [{start}, {end}) is not inside the model's [0, {n})")
        self.model = model
        self.start, self.end, self.num_layers = start, end, n
        self.first, self.last = start == 0, end == n
        # The model's cache slots, and which blocks use which, learned before the blocks are replaced.
        self._template = model.make_cache() if hasattr(model, "make_cache") else [KVCache() for _ in range(n)]
        trace = trace_blocks(model, blocks, self._template)
        _refuse_reads(model, trace, start, end)
        slots = trace.slots
        used = {k for ks in slots for k in ks}
        # The slots of this stage's blocks, and the model's own.
        self.own = sorted({k for i in range(start, end) for k in slots[i]} | set(range(len(self._template))) - used)
        self.blocks = list(blocks[start:end])  # this stage's own blocks
        self._inbox = _Inbox()
        for i in range(n):
            if i == start and not self.first:
                blocks[i] = _mimic(_Enter, blocks[i], blocks[i], self._inbox, trace.hidden)
            elif i == end:
                blocks[i] = _mimic(_Exit, blocks[i], trace.hidden)
            elif not start <= i < end:
                blocks[i] = _mimic(_Skip, blocks[i], trace.hidden, trace.returns)
        # Every other slot: the position (among this stage's caches) of one of the same
        # signature, or None (a phantom of its kind is made per call).
        mine = [kinds.signature(self._template[k]) for k in self.own]
        self._stand_in = []
        for k, c in enumerate(self._template):
            if k not in self.own:
                sig = kinds.signature(c)
                self._stand_in.append((k, mine.index(sig) if sig in mine else None))

    def launch_blocks(self) -> None:
        """Launch each block's graph as soon as it is built (``_launching``): on a device
        that computes while the thread goes on (a GPU, or a spare core), the forward is
        built while it runs, as mlx-lm's ``generate_step`` builds step k+1 while step k
        runs. The tokens are the same: each block's arrays are what they were, evaluated
        sooner."""
        for block in self.blocks:
            _launching(block)

    def drop_head(self) -> None:
        """End the forward after the range's last block (a group's other ranks on the last stage)."""
        blocks, i = layer_list(self.model), self.end - 1
        if not isinstance(blocks[i], _Enter):
            blocks[i] = _mimic(_Enter, blocks[i], blocks[i], None)
        blocks[i]._finish, self.last = True, False

    def make_cache(self) -> list:
        """Fresh caches for one sequence, one per cache slot of the range."""
        return [kinds.clone(self._template[k]) for k in self.own]

    def __call__(self, tokens: mx.array, hidden: Optional[mx.array], caches: list,
                 lengths: Optional[Sequence[int]] = None, pooled: bool = False, **extra) -> mx.array:
        """Run the range on ``tokens`` [B, L] (first stage) or ``hidden`` [B, L, D];
        ``lengths``: each row's positions before these (for caches of kinds this stage
        does not hold, which some models read positions from); ``extra``: keywords the
        model's call takes besides (a vision model's ``splice`` and ``positions``,
        ``vision.TextPart``), passed where given.

        Returns activations [B, L, D], or logits [B, L, V] on the last stage (``pooled``:
        the final hidden state there, after the model's norm: what its inner model returns).
        """
        full: List[Any] = [None] * len(self._template)
        for k, c in zip(self.own, caches):
            full[k] = c
        rows = lengths if lengths is not None else [0] * tokens.shape[0]
        for k, j in self._stand_in:
            full[k] = caches[j] if j is not None else kinds.phantom(self._template[k], list(rows))
        self._inbox.hidden = hidden
        try:
            run = self.model.model if pooled else self.model  # (pooled: the inner model's final hidden state)
            return run(tokens, cache=full, **{k: v for k, v in extra.items() if v is not None})
        except _Leave as leave:
            return leave.hidden
        finally:
            self._inbox.hidden = None


def refuse_cut(config: dict, start: int, end: int) -> None:
    """Raise ``Unsupported`` for a range short of the whole of a model in ``UNSUPPORTED``."""
    model_type = config.get("model_type")
    layers = with_sizes(config.get("text_config", config)).get("num_hidden_layers")
    if model_type in UNSUPPORTED and (start > 0 or end != layers):
        raise Unsupported(f"{model_type} models cannot be cut into stages ({UNSUPPORTED[model_type]}); "
                          "run one on a single stage")


def load_stage(path: Path, start: int, end: int, strict: bool = True,
               quant: Optional["QuantSpec"] = None, vision: bool = False) -> tuple[SlicedModel, dict]:
    """Load ``[start, end)`` of the mlx-lm model folder ``path``, lazily.

    Weights stay on disk until the first forward pass reads them; call
    ``digest.read_weights`` to read them now (and name them by their content). ``strict=False`` for a folder holding only
    this range's tensors (received from the head). With ``quant`` the folder
    holds a full-precision model and the range is read and quantized now, one
    module at a time (``quantize.py``); the config returned is the quantized one.
    ``vision``: the model's language model as mlx-vlm's (``vision.TextPart``), which takes
    images' rows and positions.
    """
    import json

    from mlx_lm.utils import load_config, load_model

    from mlxpipe.shards.models.mtp import without_mtp
    from mlxpipe.shards.models.store import BrokenModel
    from mlxpipe.shards.models.vision import load_text_part

    path = Path(path)
    try:
        refuse_cut(load_config(path), start, end)
        if quant is not None:
            model, config = quantize_range(path, start, end, quant, vision)
        elif vision:
            model, config = load_text_part(path, strict=strict)
        else:
            model, config = load_model(path, lazy=True, strict=strict, get_model_classes=without_mtp)
    except (QuantizeError, Unsupported):
        raise
    except json.JSONDecodeError as err:
        raise BrokenModel(f"{path / 'config.json'} is not valid JSON: {err}") from err
    except KeyError as err:
        raise BrokenModel(f"model folder {path} lacks the tensor {err}") from err
    except RuntimeError as err:  # MLX reading a damaged safetensors file
        raise BrokenModel(f"model folder {path} has a damaged weights file: {err}") from err
    except (ValueError, FileNotFoundError) as err:  # mlx-lm: missing or misshapen tensors, unknown model type
        raise BrokenModel(f"model folder {path} cannot be loaded: {err}") from err
    return SlicedModel(model, start, end), config


def warm_up(stage: SlicedModel, hidden_size: int) -> "kinds.Footprint":
    """Two throwaway tokens through the range: read (materialize) exactly the weights
    the range uses and compile its kernels. Returns what its caches cost: KV-cache bytes
    per token of context, bytes of one sequence's state (float32 activations assumed
    on a later stage). A range that cannot run on its own is ``Unsupported``."""
    caches = stage.make_cache()
    hidden = None if stage.first else mx.zeros((1, 1, hidden_size), dtype=mx.float32)
    try:
        for i in range(2):  # a second position: caches that allocate on the first step show their growth
            mx.eval(stage(mx.zeros((1, 1), dtype=mx.int32), hidden, caches, lengths=[i]))
    except Exception as err:  # noqa: BLE001 - the model's own code, on a range it was not written for
        raise Unsupported(f"layers [{stage.start}, {stage.end}) of {type(stage.model).__module__} cannot run "
                          f"as a stage of their own: {type(err).__name__}: {err}") from err
    footprint = kinds.footprint(caches)
    del caches
    mx.clear_cache()
    return footprint

