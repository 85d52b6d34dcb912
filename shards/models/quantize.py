"""Quantizing a full-precision model one stage's layers at a time, bit for bit as
``mlx_lm.convert -q`` does it, without ever holding (or reading) the rest.

``mlx_lm.convert`` is ``load(lazy=True)``, a dtype cast, ``quantize_model`` and
``save``. Up to ``save`` it only builds a lazy MLX graph: ``mx.load`` of a
safetensors file reads no data, and mlx-lm's ``sanitize`` (Hugging Face names,
DeepSeek-V3's FP8 ``weight_scale_inv`` dequantization, stacking experts,
splitting ``kv_b_proj``), the cast and ``mx.quantize`` are graph nodes. Each
output tensor's graph depends only on its own module's source tensors, so
evaluating just a stage's tensors reads and quantizes only those and gives what
``convert`` writes for them. ``prepare`` builds that graph with mlx-lm's own
``load_model``, ``quantize_model`` and ``mixed_quant_predicate_builder``;
``quantize_range`` evaluates one stage's tensors, one module at a time, so the
peak is the stage's quantized share plus one module at full precision;
``write_units`` writes units (a layer, ``embed``, ``head``) one at a time, for
the head's cache of quantized weights and for ``mlxpipe quantize``.

The only lines taken from mlx-lm rather than called are the ten of
``convert()`` that choose and apply the dtype (``_convert_dtype``): they are
inline there, not a function. The tests compare with ``convert`` itself.
"""

from __future__ import annotations

import contextlib
import copy
import glob
import io
import json
import logging
import shutil
from pathlib import Path
from typing import Callable, Dict, Iterable, List, Optional, Tuple, Union

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_map_with_path
from mlx_lm.convert import MODEL_CONVERSION_DTYPES, mixed_quant_predicate_builder
from mlx_lm.utils import get_total_parameters, load_model, load_tokenizer, quantize_model, save_config

from mlxpipe.shards.models.layers import layer_list
from mlxpipe.shards.models.weights import LAYER_RE, range_unit_names, unit_file, unit_of
from mlxpipe.shards.params.quant import BITS, QuantSpec

logger = logging.getLogger(__name__)

Predicate = Callable[[str, nn.Module], Union[bool, dict]]


class QuantizeError(ValueError):
    """A model or spec that cannot be quantized as asked; the message says why."""


def _num_layers(model: nn.Module) -> int:
    return len(layer_list(model))


def _convert_dtype(model: nn.Module, config: dict) -> None:
    """The dtype step of ``mlx_lm.convert.convert`` (inline there, so copied): cast
    floating parameters to ``torch_dtype`` (or ``text_config.dtype``), as the model's
    ``cast_predicate`` allows."""
    dtype = config.get("torch_dtype", None)
    if dtype is None and (text := config.get("text_config", None)):
        dtype = text.get("dtype", None)
    if dtype in MODEL_CONVERSION_DTYPES:
        target = getattr(mx, dtype)
        cast_predicate = getattr(model, "cast_predicate", lambda _: True)

        def set_dtype(k, v):
            if cast_predicate(k) and mx.issubdtype(v.dtype, mx.floating):
                return v.astype(target)
            return v

        model.update(tree_map_with_path(set_dtype, model.parameters()))


def spec_predicate(model: nn.Module, spec: QuantSpec) -> Optional[Predicate]:
    """The ``quant_predicate`` that ``quantize_model`` gets for ``spec``.

    Uniform bits: None, so mlx-lm applies the model's own predicate (as ``convert``
    does). A uniform recipe: mlx-lm's recipe predicate (which, as in ``convert``,
    replaces the model's own). Per-layer rungs: the model's own predicate is asked
    first (a False or its own parameters win, e.g. Qwen3-MoE's 8-bit router); then
    a layer's module follows its rung (the recipe's choice for that module, or its
    bits), everything else the spec's ``bits``. Modules at the spec's own bits get
    no per-module entry in the config.
    """
    recipes: Dict[str, Predicate] = {}

    def recipe(name: str) -> Predicate:
        if name not in recipes:
            recipes[name] = mixed_quant_predicate_builder(name, model, spec.group_size)
        return recipes[name]

    if spec.layer_bits is None:
        return None if spec.bits in BITS else recipe(spec.bits)
    spec.check_layers(_num_layers(model))
    base = getattr(model, "quant_predicate", None)

    def predicate(path: str, module: nn.Module) -> Union[bool, dict]:
        verdict = base(path, module) if base is not None else True
        if not verdict or isinstance(verdict, dict):
            return verdict
        m = LAYER_RE.search(path + ".")
        rung = spec.layer(int(m.group(1))) if m else spec.bits
        if rung not in BITS:
            return recipe(rung)(path, module)
        if rung == spec.bits:
            return True
        return {"group_size": spec.group_size, "bits": int(rung), "mode": "affine"}

    return predicate


def prepare(path: Union[str, Path], spec: QuantSpec, vision: bool = False) -> Tuple[nn.Module, dict]:
    """The whole model at ``path`` loaded and quantized by ``spec`` the way
    ``mlx_lm.convert`` does it, as a lazy graph: nothing is read yet. Returns the
    model and the config ``convert`` would write. ``vision``: the language model of a
    vision-language model, as mlx-vlm's (``vision.TextPart``; its tower is the head's,
    kept as stored, as ``mlx_vlm.convert`` keeps it)."""
    if vision:
        from mlxpipe.shards.models.vision import load_text_part

        model, config = load_text_part(Path(path))
    else:
        model, config = load_model(Path(path), lazy=True)
    if "quantization" in config:
        raise QuantizeError(f"{path} is already quantized ({config['quantization'].get('bits')}-bit); "
                            "quantize from a full-precision folder (bf16, fp16, fp32 or DeepSeek's FP8)")
    _convert_dtype(model, config)
    predicate = spec_predicate(model, spec)
    bits = int(spec.bits) if spec.bits in BITS else None  # a recipe: mlx-lm's default (4) names the config
    with contextlib.redirect_stdout(io.StringIO()):  # quantize_model prints its bits per weight
        return quantize_model(model, config, spec.group_size, bits, quant_predicate=predicate)


def model_units(model: nn.Module) -> Dict[str, Dict[str, mx.array]]:
    """The model's parameters by unit (lazy arrays: nothing is read)."""
    units: Dict[str, Dict[str, mx.array]] = {}
    for name, arr in tree_flatten(model.parameters()):
        units.setdefault(unit_of(name), {})[name] = arr
    return units


def stage_units(model: nn.Module, start: int, end: int) -> Dict[str, Dict[str, mx.array]]:
    """The tensors of each unit a stage with layers ``[start, end)`` needs (lazy)."""
    n = _num_layers(model)
    if not 0 <= start < end <= n:
        raise QuantizeError(f"layer range [{start}, {end}) is not inside the model's [0, {n})")
    units = model_units(model)
    tied = not any("lm_head" in k for k in units.get("head", {}))
    return {u: units[u] for u in range_unit_names(start, end, n, tied) if u in units}


def materialize(tensors: Dict[str, mx.array]) -> None:
    """Evaluate ``tensors`` one module at a time (weight, scales and biases come from
    one ``mx.quantize``), so one module's full-precision source is in memory at once."""
    modules: Dict[str, List[mx.array]] = {}
    for name, arr in tensors.items():
        modules.setdefault(name.rsplit(".", 1)[0], []).append(arr)
    for arrays in modules.values():
        mx.eval(arrays)


def quantize_range(path: Union[str, Path], start: int, end: int, spec: QuantSpec,
                   vision: bool = False) -> Tuple[nn.Module, dict]:
    """Layers ``[start, end)`` of the full-precision model at ``path``, quantized by ``spec``.

    Returns the whole mlx-lm model and ``convert``'s config: the tensors of the
    range's units are evaluated (bit-identical to ``mlx_lm.convert``'s), every
    other tensor is a lazy graph that is never read. The allocator's cache is
    released after each unit.
    """
    model, config = prepare(path, spec, vision)
    for tensors in stage_units(model, start, end).values():
        materialize(tensors)
        mx.clear_cache()
    return model, config


def _release(model: nn.Module, names: Iterable[str]) -> None:
    """Replace parameters by empty arrays (what ``save_model(donate_model=True)`` does)."""
    for name in names:
        *path, leaf = name.split(".")
        obj = model
        for p in path:
            obj = obj[int(p)] if isinstance(obj, list) else obj[p]
        obj[leaf] = mx.array([])


def write_units(model: nn.Module, out: Union[str, Path], units: Optional[Iterable[str]] = None) -> Dict[str, str]:
    """Evaluate each unit of a ``prepare``d model, write it to ``out/model-<unit>.safetensors``
    (the name a node gives a received unit) and release its arrays, one unit at a
    time: the peak is one quantized unit plus one module at full precision.
    Returns the weight map (tensor -> file). A unit can be written once per ``prepare``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    everything = model_units(model)
    order = sorted(everything, key=lambda u: (u != "embed", u == "head", u)) if units is None else list(units)
    weight_map: Dict[str, str] = {}
    for u in order:
        tensors = everything.pop(u)
        if any(a.size == 0 for a in tensors.values()):
            raise QuantizeError(f"unit {u} was written and released already; prepare the model again")
        materialize(tensors)
        tmp = out / ".partial" / unit_file(u)  # renamed into place once whole
        tmp.parent.mkdir(exist_ok=True)
        mx.save_safetensors(str(tmp), tensors, metadata={"format": "mlx"})
        tmp.replace(out / unit_file(u))
        weight_map.update({k: unit_file(u) for k in tensors})
        _release(model, list(tensors))
        del tensors
        mx.clear_cache()
    shutil.rmtree(out / ".partial", ignore_errors=True)
    return weight_map


def write_config(config: dict, out: Union[str, Path]) -> None:
    """The ``config.json`` that ``convert`` writes for this config (mlx-lm's ``save_config``)."""
    Path(out).mkdir(parents=True, exist_ok=True)
    save_config(copy.deepcopy(config), config_path=Path(out) / "config.json")


def quantize_folder(src: Union[str, Path], out: Union[str, Path], spec: QuantSpec) -> dict:
    """``mlxpipe quantize``: a folder ``mlx_lm.load`` reads, tensor for tensor what
    ``mlx_lm.convert -q`` writes, made one unit at a time (never the whole model at
    full precision). Returns the quantized config."""
    src, out = Path(src), Path(out)
    if out.exists():
        raise QuantizeError(f"{out} already exists")
    model, config = prepare(src, spec)
    total_size = sum(a.nbytes for _, a in tree_flatten(model.parameters()))  # shapes only
    total_parameters = get_total_parameters(model)
    weight_map = write_units(model, out)
    index = {"metadata": {"total_size": total_size, "total_parameters": total_parameters},
             "weight_map": dict(sorted(weight_map.items()))}  # save_model's index (its shards would be 5 GB at once)
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=4))
    write_config(config, out)
    # The rest of mlx_lm.utils.save: the tokenizer, code files, generation config.
    load_tokenizer(src).save_pretrained(out)
    for pattern in ("*.py", "generation_config.json"):
        for f in glob.glob(str(src / pattern)):
            shutil.copy(f, out)
    logger.info("quantized %s into %s: %s, %.1f MB", src, out, spec.describe(), total_size / 1e6)
    return config
