"""Arrays to and from the wire: the one place that does it.

A tensor travels as shape + dtype name + raw little-endian bytes in C order.
Decoding checks everything before touching the bytes: the dtype is one we
allow, the shape is sane, and shape x itemsize equals the byte count; and
after decoding, that every value is finite (a NaN or infinity in the
activations would turn every later layer's output, and the sampled token,
into noise without any error).

No numpy round trip: an array's bytes are read through its own buffer
(``memoryview`` of an ``mx.array``, one copy into the message), and a
message's bytes become an array through a typed ``memoryview`` of them (one
copy into MLX), as unsigned integers of the dtype's width (``memoryview``
knows no float16 or bfloat16 format) viewed back as their dtype in MLX. The
finiteness check reads the exponent bits of those integers in place (all
ones: infinity or NaN), with numpy on the calling thread: exact, several times
faster than ``isfinite`` on 16-bit floats, and no MLX evaluation (on Metal, a
GPU round trip) per frame.
"""

from __future__ import annotations

import math
import sys
from typing import Optional, Sequence

import mlx.core as mx
import numpy as np

from mlxpipe.proto import pipeline_pb2 as pb

if sys.byteorder != "little":  # the wire is little-endian, and a memoryview is native
    raise ImportError("mlxpipe's codec needs a little-endian machine")

# dtype name -> (mlx dtype, struct format its bytes move as, bytes per value, exponent bits)
_DTYPES = {
    "float32": (mx.float32, "I", 4, np.uint32(0x7F800000)),
    "float16": (mx.float16, "H", 2, np.uint16(0x7C00)),
    "bfloat16": (mx.bfloat16, "H", 2, np.uint16(0x7F80)),
}
MAX_DIMS = 4


class WireError(ValueError):
    """A tensor on the wire that cannot be decoded; the message says why."""


def dtype_name(dtype: mx.Dtype) -> str:
    for name, (mxd, *_) in _DTYPES.items():
        if mxd == dtype:
            return name
    raise WireError(f"dtype {dtype} cannot be sent (allowed: {sorted(_DTYPES)})")


def encode(x: mx.array, into: Optional[pb.Tensor] = None) -> pb.Tensor:
    """An evaluated (or evaluable) array as a Tensor message: a new one, or
    ``into`` (a frame's field: filled in place, saving the copy of a CopyFrom)."""
    name = dtype_name(x.dtype)
    view = memoryview(x)  # evaluates x; no copy
    if not view.c_contiguous:  # a slice or transpose: C order first
        view = memoryview(mx.contiguous(x))
    t = pb.Tensor() if into is None else into
    t.shape[:] = x.shape
    t.dtype = name
    t.data = view.cast("B").tobytes()
    return t


def decode(t: pb.Tensor, *, expect_shape: Sequence[int] | None = None) -> mx.array:
    """A Tensor message as an mx.array, after checking it is well formed.

    ``expect_shape`` (optional) must equal the tensor's shape exactly.
    """
    if t.dtype not in _DTYPES:
        raise WireError(
            f"tensor dtype {t.dtype!r} is not allowed (allowed: {sorted(_DTYPES)})"
        )
    shape = tuple(int(d) for d in t.shape)
    if not 1 <= len(shape) <= MAX_DIMS or any(d <= 0 for d in shape):
        raise WireError(f"tensor shape {list(shape)} is not a valid shape")
    if expect_shape is not None and shape != tuple(expect_shape):
        raise WireError(
            f"tensor shape {list(shape)} does not match the frame, expected {list(expect_shape)}"
        )
    mxd, fmt, itemsize, exponent = _DTYPES[t.dtype]
    data = t.data
    want = math.prod(shape) * itemsize
    if len(data) != want:
        raise WireError(
            f"tensor of shape {list(shape)} and dtype {t.dtype} needs {want} bytes, got {len(data)}"
        )
    if (np.frombuffer(data, dtype=exponent.dtype) & exponent).max() == exponent:
        raise WireError("tensor values are not finite (NaN or infinity)")
    return mx.array(memoryview(data).cast(fmt, shape)).view(mxd)
