"""What a model's weights cost in bytes, module by module: affine quantization as mlx-lm
writes it (``Quant``), the bits each module gets from a ``QuantSpec`` (``Scheme``: one for
all, a layer's rung, or a mixed recipe's choice), and a layer's parts added up (``Parts``).
The cost model (``cost.py``) builds each layer's figures from these. Pure Python.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, Optional

from mlxpipe.shards.models.weights import LAYER_RE
from mlxpipe.shards.params.quant import RECIPES, QuantSpec


@dataclass(frozen=True)
class Quant:
    """Bytes of weights: affine quantization as mlx-lm writes it, or plain 16-bit."""

    bits: Optional[int]
    group_size: int
    dtype_bytes: int

    def quantizes(self, cols: int) -> bool:
        # cols is the input dimension, the one groups run along; mlx-lm skips a module it does not divide.
        return self.bits is not None and cols % self.group_size == 0

    def matrix(self, rows: int, cols: int, count: int = 1) -> int:
        n = rows * cols * count
        if not self.quantizes(cols):
            return n * self.dtype_bytes
        return n * self.bits // 8 + (n // self.group_size) * 2 * self.dtype_bytes

    def plain(self, n: int) -> int:
        return n * self.dtype_bytes


class Scheme:
    """The ``Quant`` of each weight matrix, by its module path (as mlx-lm names it):
    one for all (``bits``), or the rung a ``QuantSpec`` gives its layer, where a
    mixed recipe's rung decides module by module with mlx-lm's own rule."""

    def __init__(self, bits: Optional[int], group_size: int, dtype_bytes: int,
                 spec: Optional[QuantSpec] = None, num_layers: int = 0) -> None:
        self.uniform = Quant(bits, group_size, dtype_bytes)
        self.spec, self.num_layers, self.dtype_bytes = spec, num_layers, dtype_bytes
        self._recipes: Dict[str, Callable[[str], int]] = {}

    def __call__(self, path: str) -> Quant:
        if self.spec is None:
            return self.uniform
        m = LAYER_RE.search(path + ".")
        rung = self.spec.layer(int(m.group(1))) if m else self.spec.bits
        bits = self._recipe(rung)(path) if rung in RECIPES else int(rung)
        return Quant(bits, self.spec.group_size, self.dtype_bytes)

    def _recipe(self, name: str) -> Callable[[str], int]:
        """mlx-lm's recipe predicate, asked about module paths (it needs of a model only
        the name of a down projection and the number of layers)."""
        if name not in self._recipes:
            from mlx_lm.convert import mixed_quant_predicate_builder

            class _Outline:
                layers = [None] * self.num_layers

                @staticmethod
                def named_modules():
                    return [("model.layers.0.mlp.down_proj", None)]

            predicate = mixed_quant_predicate_builder(name, _Outline(), self.spec.group_size)
            self._recipes[name] = lambda path: predicate(path, None)["bits"]
        return self._recipes[name]


class Parts:
    """Accumulates (params, bytes) of a layer as always-read and partly-read parts."""

    def __init__(self) -> None:
        self.params = self.active = self.bytes = self.read = self.qparams = self.qbits = 0

    def add(self, params: int, nbytes: int, fraction: float = 1.0) -> None:
        self.params += params
        self.bytes += nbytes
        self.active += round(params * fraction)
        self.read += round(nbytes * fraction)

    def matrix(self, q: Quant, rows: int, cols: int, count: int = 1, fraction: float = 1.0) -> None:
        """A weight matrix [rows, cols] (``count`` of them: stacked experts)."""
        n = rows * cols * count
        self.add(n, q.matrix(rows, cols, count), fraction)
        if q.quantizes(cols):
            self.qparams += n
            self.qbits += n * q.bits
