"""A tree of arrays as one safetensors file: how the prefix cache's disk tier stores a block.

``encode`` takes any tree of lists, tuples and dicts of ``mx.array``s and plain values
(and mlx-lm's cache objects inside a snapshot, by class): arrays are named by their path
in the tree (``kv.12.0``) and the tree's shape goes in the file's metadata, so that what
a stage holds is stored as it is (a quantized cache's keys as their data, scales and
biases) with no code per cache kind. The file is a plain safetensors file (``mx.load``
reads it); ``decode`` builds the tree again, and refuses with ``ValueError`` (or
``KeyError``, ``TypeError``) what it did not write. Arrays come back materialized (made
from the bytes, never a lazy load), so that a thread other than MLX's can read them.
"""

from __future__ import annotations

import importlib
import json
import math
import threading
from typing import Any, Dict, List, Optional, Tuple

import mlx.core as mx
import numpy as np

FORMAT = "mlxpipe-prefix-block/1"
ARRAY_HEADER_BYTES = 192  # what an array adds to a file's header, about
_local = threading.local()

# safetensors' name of each dtype, and the numpy type its bytes are read as (bfloat16 as uint16, then viewed)
_DTYPES = {mx.bool_: ("BOOL", np.bool_), mx.uint8: ("U8", np.uint8), mx.uint16: ("U16", np.uint16),
           mx.uint32: ("U32", np.uint32), mx.uint64: ("U64", np.uint64), mx.int8: ("I8", np.int8),
           mx.int16: ("I16", np.int16), mx.int32: ("I32", np.int32), mx.int64: ("I64", np.int64),
           mx.float16: ("F16", np.float16), mx.bfloat16: ("BF16", np.uint16), mx.float32: ("F32", np.float32)}
_BY_NAME = {name: (dtype, np_type) for dtype, (name, np_type) in _DTYPES.items()}


def _flatten(value: Any, path: str, arrays: Dict[str, mx.array]) -> dict:
    """The shape of ``value`` as JSON, its arrays put in ``arrays`` under their paths."""
    if isinstance(value, mx.array):
        name = path or "_"
        while name in arrays:
            name += "_"
        arrays[name] = value
        return {"a": name}
    if value is None or isinstance(value, (bool, int, float, str)):
        return {"v": value}
    if isinstance(value, (list, tuple)):
        items = [_flatten(v, f"{path}.{i}" if path else str(i), arrays) for i, v in enumerate(value)]
        return {"l" if isinstance(value, list) else "t": items}
    if isinstance(value, dict):
        if not all(isinstance(k, (str, int)) and not isinstance(k, bool) for k in value):
            raise TypeError("a stored dict's keys must be strings or integers")
        return {"d": [[k, _flatten(v, f"{path}.{k}" if path else str(k), arrays)] for k, v in value.items()]}
    cls = type(value)
    if cls.__module__.startswith("mlx_lm.") and hasattr(value, "update_and_fetch"):  # a cache inside a state
        return {"c": f"{cls.__module__}:{cls.__qualname__}", "s": _flatten(vars(value), path, arrays)}
    raise TypeError(f"a {cls.__name__} cannot be stored in a prefix block")


def _cache_class(name: str) -> type:
    module, _, qualname = name.partition(":")
    if not module.startswith("mlx_lm."):
        raise ValueError(f"cache class {name!r} is not mlx-lm's")
    cls: Any = importlib.import_module(module)
    for part in qualname.split("."):
        cls = getattr(cls, part)
    if not isinstance(cls, type) or not hasattr(cls, "update_and_fetch"):
        raise ValueError(f"{name!r} is not a cache class")
    return cls


def _build(spec: dict, arrays: Dict[str, mx.array]) -> Any:
    """The tree ``_flatten`` described."""
    if "a" in spec:
        return arrays[spec["a"]]
    if "v" in spec:
        return spec["v"]
    if "l" in spec:
        return [_build(s, arrays) for s in spec["l"]]
    if "t" in spec:
        return tuple(_build(s, arrays) for s in spec["t"])
    if "d" in spec:
        return {k: _build(s, arrays) for k, s in spec["d"]}
    if "c" in spec:
        cls = _cache_class(spec["c"])
        state = _build(spec["s"], arrays)
        if not isinstance(state, dict):
            raise ValueError("a cache's state is not a dict")
        out = cls.__new__(cls)
        out.__dict__.update(state)
        return out
    raise ValueError(f"unknown node in a stored tree: {sorted(spec)}")


def encode(tree: Any, meta: Dict[str, str]) -> Tuple[List[Any], int]:
    """``tree`` as the chunks of a safetensors file (its header, then each array's
    bytes) and their total size. Its arrays must be evaluated."""
    arrays: Dict[str, mx.array] = {}
    spec = _flatten(tree, "", arrays)
    header, chunks, offset = {}, [], 0
    for name, a in arrays.items():
        if a.dtype not in _DTYPES:
            raise TypeError(f"arrays of {a.dtype} cannot be stored in a prefix block")
        view = memoryview(a)
        chunks.append(view if view.c_contiguous else view.tobytes())
        header[name] = {"dtype": _DTYPES[a.dtype][0], "shape": list(a.shape),
                        "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
    header["__metadata__"] = dict(meta, format=FORMAT, tree=json.dumps(spec, separators=(",", ":")))
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    head = len(raw).to_bytes(8, "little") + raw
    return [head, *chunks], len(head) + offset


def declared_size(data: bytes) -> Optional[int]:
    """The size a file's header says it has (at least), or None where no header reads."""
    if len(data) < 8:
        return 8
    n = int.from_bytes(data[:8], "little")
    if n > len(data) - 8:
        return 8 + n
    try:
        header = json.loads(data[8 : 8 + n])
        return 8 + n + max((int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__"), default=0)
    except (ValueError, KeyError, TypeError, AttributeError, IndexError):
        return None


def decode(data: bytes) -> Tuple[Any, Dict[str, str]]:
    """The tree and metadata of a file ``encode`` wrote; ValueError (or KeyError,
    TypeError) when it is not one."""
    if len(data) < 8:
        raise ValueError("shorter than a header")
    n = int.from_bytes(data[:8], "little")
    if n > len(data) - 8:
        raise ValueError("header longer than the file")
    header = json.loads(data[8 : 8 + n])
    meta = header.pop("__metadata__", None) or {}
    if meta.get("format") != FORMAT:
        raise ValueError("not a prefix block")
    body = memoryview(data)[8 + n :]
    arrays, views = {}, []
    for name, t in header.items():
        dtype, np_type = _BY_NAME[t["dtype"]]
        shape = [int(d) for d in t["shape"]]
        a, b = (int(x) for x in t["data_offsets"])
        count = math.prod(shape)
        if not 0 <= a <= b <= len(body) or b - a != count * np.dtype(np_type).itemsize:
            raise ValueError(f"array {name!r} does not fit the file")
        arrays[name] = mx.array(np.frombuffer(body, dtype=np_type, count=count, offset=a).reshape(shape))
        if dtype == mx.bfloat16:  # numpy has no bfloat16: its bits, viewed as one (on this thread's stream)
            with mx.stream(_stream()):
                arrays[name] = arrays[name].view(mx.bfloat16)
            views.append(arrays[name])
    mx.eval(views)
    return _build(json.loads(meta["tree"]), arrays), meta


def _stream():
    """This thread's own MLX stream, on the CPU (a view is no computation: nothing for a
    GPU to do): arrays made here are evaluated here, never lazily on the stage's MLX thread."""
    stream = getattr(_local, "stream", None)
    if stream is None:
        stream = _local.stream = mx.new_stream(mx.cpu)
    return stream


def block_file_bytes(block_tokens: int, kv_bytes_per_token: int, arrays: int) -> int:
    """What one block's file takes, about (without a state snapshot): its keys and
    values, and a header for ``arrays`` arrays (the head's estimate of a block on disk)."""
    return block_tokens * kv_bytes_per_token + 1024 + ARRAY_HEADER_BYTES * arrays
