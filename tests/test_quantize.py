"""Quantizing by the pipeline: each stage quantizes its own layers, bit for bit as
``mlx_lm.convert -q`` does; nodes without the model receive them quantized; the
planner picks the bits that fit; ``mlxpipe quantize``; ``mlxpipe bench quality``."""

from __future__ import annotations

import asyncio
import json
import shutil

import mlx.core as mx
import pytest
from conftest import PROMPTS, SECRET, node_process, run_async, stage_stub
from mlx.utils import tree_flatten

from mlxpipe.proto import pipeline_pb2 as pb
from mlxpipe.proto.rpc import Security
from mlxpipe.server.cluster.assembly import Cluster
from mlxpipe.server.cluster.cost import load_model_cost
from mlxpipe.server.config import ClusterConfig
from mlxpipe.server.core.streams import collect
from mlxpipe.shards.models.quantize import QuantizeError, quantize_range, stage_units
from mlxpipe.shards.models.store import fingerprint
from mlxpipe.shards.models.weights import model_units, unit_of, units_for_range
from mlxpipe.shards.params import wire
from mlxpipe.shards.params.quant import RECIPES, QuantSpec, quantized_fingerprint

NEW_TOKENS = 24
_loaded = {}


def tensors(path):
    """Every tensor of the model folder at ``path`` as ``mlx_lm.load`` gives it."""
    from mlx_lm import load

    if str(path) not in _loaded:
        model, _ = load(str(path))
        _loaded[str(path)] = dict(tree_flatten(model.parameters()))
    return _loaded[str(path)]


def assert_same(ours: dict, ref: dict, units) -> int:
    """``ours`` holds exactly ``ref``'s tensors of ``units``, bit for bit."""
    assert set(ours) == {k for k in ref if unit_of(k) in units}
    for k, v in ours.items():
        assert (v.dtype, v.shape) == (ref[k].dtype, ref[k].shape), k
        assert mx.array_equal(v, ref[k]).item(), f"{k} differs"
    return len(ours)


def flat(units: dict) -> dict:
    return {k: v for t in units.values() for k, v in t.items()}


# -- a stage's tensors: convert's, bit for bit -------------------------------------------

CASES = [  # (source, bits, group size, recipe)
    ("dsv3", 4, 64, None),            # bf16 DeepSeek-V3 in the Hugging Face layout
    ("dsv3-fp8", 4, 64, None),        # FP8 + weight_scale_inv, dequantized by mlx-lm's sanitize
    ("dsv3-fp8", None, 64, "mixed_2_6"),
    ("llama", 3, 32, None),
    ("llama", None, 64, "mixed_3_6"),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(str(x) for x in c if x))
def test_each_stage_range_is_bit_identical_to_convert(case, sources, converted, tmp_path):
    name, bits, group, recipe = case
    conv = converted(name, bits or 4, group, recipe)
    ref = tensors(conv)
    spec = QuantSpec(recipe or str(bits), group)
    covered = set()
    for start, end in [(0, 2), (1, 3), (2, 4)]:
        model, config = quantize_range(sources(name), start, end, spec)
        units = stage_units(model, start, end)
        assert assert_same(flat(units), ref, set(units)) > 0
        covered |= set(units)
    assert covered == {unit_of(k) for k in ref}
    # The quantized config is the one convert writes (per-module entries of recipes included).
    from mlx_lm.utils import save_config

    save_config(json.loads(json.dumps(config)), config_path=tmp_path / "config.json")
    assert json.loads((tmp_path / "config.json").read_text()) == json.loads((conv / "config.json").read_text())


def test_only_the_range_is_read(sources, converted, tmp_path):
    """Garble every source tensor that layers [0, 2) do not need: their quantized tensors
    are still convert's of the clean source (nothing else was read)."""
    from mlxpipe.shards.models.weights import read_header

    bad = tmp_path / "garbled"
    shutil.copytree(sources("dsv3-fp8"), bad)
    header, start = read_header(bad / "model.safetensors")
    data = bytearray((bad / "model.safetensors").read_bytes())
    for k, info in header.items():
        if k != "__metadata__" and unit_of(k) not in {"layer-00000", "layer-00001", "embed"}:
            a, b = info["data_offsets"]
            data[start + a:start + b] = b"\x7f" * (b - a)
    (bad / "model.safetensors").write_bytes(bytes(data))
    model, _ = quantize_range(bad, 0, 2, QuantSpec("4"))
    units = stage_units(model, 0, 2)
    assert_same(flat(units), tensors(converted("dsv3-fp8")), set(units))


def test_a_quantized_folder_is_refused(converted):
    with pytest.raises(QuantizeError, match="already quantized"):
        quantize_range(converted("llama", 4), 0, 2, QuantSpec("4"))


# -- per-layer bits, mlx-lm's config, and `mlxpipe quantize` ------------------------------

LAYER_BITS = ("3", "mixed_3_6", "8", "4")


def test_layer_bits_read_back_and_each_layer_is_converts_at_its_bits(sources, converted, tmp_path):
    """Per-layer rungs become per-module entries of mlx-lm's config: mlx_lm.load reads
    the folder back, it equals what stages quantize, and each layer is what convert
    writes at that layer's rung; the cost model predicts every unit's size exactly."""
    from mlxpipe.server.cli.main import main

    src = sources("llama")
    out = tmp_path / "mixed"
    assert main(["quantize", "--model", str(src), "--bits", "4", "--layer-bits", ",".join(LAYER_BITS),
                 str(out)]) == 0
    spec = QuantSpec("4", 64, LAYER_BITS)
    got = tensors(out)
    for start, end in [(0, 2), (2, 4)]:
        model, _ = quantize_range(src, start, end, spec)
        units = stage_units(model, start, end)
        assert_same(flat(units), got, set(units))
    for i, rung in enumerate(LAYER_BITS):
        ref = tensors(converted("llama", 4, 64, rung) if rung in RECIPES else converted("llama", int(rung)))
        assert_same({k: v for k, v in got.items() if unit_of(k) == f"layer-{i:05d}"}, ref, {f"layer-{i:05d}"})
    assert_same({k: v for k, v in got.items() if unit_of(k) == "embed"}, tensors(converted("llama", 4)), {"embed"})
    cost = load_model_cost(src, quant=spec)
    sizes = {u: x.data_bytes for u, x in model_units(out).items()}
    assert [l.weight_bytes for l in cost.layers] == [sizes[f"layer-{i:05d}"] for i in range(4)]
    assert cost.embed_bytes == sizes["embed"]


def test_quantize_command_writes_what_convert_writes(sources, converted, tmp_path):
    from mlxpipe.server.cli.main import main

    out = tmp_path / "q4"
    assert main(["quantize", "--model", str(sources("dsv3-fp8")), "--bits", "4", str(out)]) == 0
    conv = converted("dsv3-fp8", 4)
    ref = tensors(conv)
    assert assert_same(tensors(out), ref, {unit_of(k) for k in ref}) == len(ref)
    assert json.loads((out / "config.json").read_text()) == json.loads((conv / "config.json").read_text())
    index, ref_index = (json.loads((d / "model.safetensors.index.json").read_text()) for d in (out, conv))
    assert index["metadata"] == ref_index["metadata"] and set(index["weight_map"]) == set(ref_index["weight_map"])
    # One file per unit, named as a node names what it receives; the cost model is exact.
    assert sorted(p.name for p in out.glob("*.safetensors")) == sorted(
        f"model-{u}.safetensors" for u in model_units(out))
    cost = load_model_cost(sources("dsv3-fp8"), quant=QuantSpec("4"))
    sizes = {u: x.data_bytes for u, x in model_units(out).items()}
    assert [l.weight_bytes for l in cost.layers] == [sizes[f"layer-{i:05d}"] for i in range(4)]
    assert (cost.embed_bytes, cost.head_bytes) == (sizes["embed"], sizes["head"])
    assert main(["quantize", "--model", str(sources("dsv3-fp8")), "--bits", "4", str(out)]) == 2  # exists


# -- served: real stage processes ----------------------------------------------------------


def _prompts(path):
    from mlx_lm.utils import load_tokenizer

    tok = load_tokenizer(path)
    return [tok.encode(p) for p in PROMPTS]


async def _serve(cfg: ClusterConfig, prompts):
    async with Cluster(cfg) as cluster:
        outs = [[t.id for t in toks] for toks in await asyncio.gather(
            *(collect(cluster.engine.submit(p, NEW_TOKENS)) for p in prompts))]
        stages = [(st.start, st.end, st.load, st.weights_sent) for st in cluster.pipeline.stages]
        return outs, stages, cluster


@pytest.mark.parametrize("stages", [2, 3])
def test_bits_4_served_equals_convert_and_mlx_lm(stages, sources, converted, reference):
    """The Done-when: a bf16 tiny DeepSeek-V3 served through stages that each quantize
    their own layers (`--bits 4`) generates what `mlx_lm.convert -q --q-bits 4` plus
    single-process mlx-lm generate, token for token."""
    src, conv = sources("dsv3"), converted("dsv3", 4)
    prompts = _prompts(src)
    outs, placed, _ = run_async(_serve(ClusterConfig(model=str(src), stages=stages, bits="4", chunk_size=8), prompts))
    assert len(placed) == stages
    qfp = quantized_fingerprint(fingerprint(src), QuantSpec("4"))
    for start, end, load, _ in placed:
        assert load.fingerprint == qfp
        # A stage holds its share of the 4-bit model, not the bf16 one.
        want = sum(u.data_bytes for u in units_for_range(model_units(conv), start, end, 4))
        assert want <= load.weight_bytes < 1.5 * want
    for prompt, got in zip(prompts, outs):
        assert got == reference(conv, prompt, NEW_TOKENS)


def test_bits_auto_on_local_stages_takes_the_most_that_fits(sources, converted, reference):
    """Local stages offer this machine's memory, which holds the tiny model at 8 bits:
    `--bits auto` profiles at 4 bits, plans, and serves 8-bit, convert's 8-bit tokens."""
    src = sources("dsv3")
    prompts = _prompts(src)[:1]
    outs, placed, cluster = run_async(_serve(ClusterConfig(model=str(src), stages=2, bits="auto"), prompts))
    assert cluster.quant == QuantSpec("8")
    assert {p[2].fingerprint for p in placed} == {quantized_fingerprint(fingerprint(src), QuantSpec("8"))}
    assert outs[0] == reference(converted("dsv3", 8), prompts[0], NEW_TOKENS)


def test_stage_peak_memory_is_its_share_plus_under_one_full_layer(tmp_path, default_model):
    """A stage process quantizing layers [3, 5) of an 8-layer bf16 model: MLX's peak
    memory while loading (LoadReply.mlx_peak_bytes) stays under the range's 4-bit share plus
    one layer at full precision, far below the model; the process's peak (peak_bytes) holds it."""
    from tiny_models import build_llama_source

    src = build_llama_source(tmp_path / "models" / "wide", default_model, hidden_size=512, intermediate_size=1536,
                             num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=8, head_dim=64,
                             vocab_size=4096)
    layer_bytes = {u: x.data_bytes for u, x in model_units(src).items()}
    proc, address = node_process(tmp_path / "home", "--models-dir", str(tmp_path / "models"))
    try:
        reply = stage_stub(address).Load(pb.LoadRequest(model=str(src), start=3, end=5,
                                                        quantization=wire.quant_to_wire(QuantSpec("4"))), timeout=120)
    finally:
        proc.kill()
        proc.wait()
    share = sum(load_model_cost(src, quant=QuantSpec("4")).layers[i].weight_bytes for i in (3, 4))
    assert share <= reply.weight_bytes
    assert 0 < reply.mlx_peak_bytes < share + layer_bytes["layer-00003"], (reply.mlx_peak_bytes, share)
    assert reply.mlx_peak_bytes < 0.25 * sum(layer_bytes.values())
    assert reply.peak_bytes > reply.mlx_peak_bytes


def test_a_node_without_the_model_receives_its_layers_quantized(sources, converted, reference, tmp_path,
                                                                 monkeypatch):
    """Node 0 holds the bf16 model and quantizes its own layers; node 1 has nothing and
    receives its layers already quantized by the head (one unit at a time into the head's
    cache), checksummed; they agree on the model, and generate what convert's model does.
    Next time the node's received cache serves: nothing moves."""
    monkeypatch.setenv("MLXPIPE_HOME", str(tmp_path / "head"))  # the head's cache of quantized units
    src = sources("dsv3")
    models = tmp_path / "models"
    shutil.copytree(src, models / "dsv3")
    model = models / "dsv3"
    conv = converted("dsv3", 4)
    nodes = [node_process(tmp_path / "home0", "--models-dir", str(models)),
             node_process(tmp_path / "home1", "--models-dir", str(tmp_path / "empty"))]
    prompts = _prompts(model)[:1]
    try:
        cfg = ClusterConfig(model=str(model), nodes=[a for _, a in nodes], split="even", bits="4",
                            security=Security(secret=SECRET))
        outs, placed, cluster = run_async(_serve(cfg, prompts), timeout=180)
        assert outs[0] == reference(conv, prompts[0], NEW_TOKENS)
        (s0, e0, _, sent0), (s1, e1, _, sent1) = placed
        assert sent0 == 0
        cache = next(iter(cluster._quantized.values())).folder
        assert sent1 == sum(u.data_bytes for u in units_for_range(model_units(cache), s1, e1, 4))
        assert sent1 < sum(u.data_bytes for u in units_for_range(model_units(model), s1, e1, 4)) / 2
        # The head's cache holds convert's tensors, and only the units a node lacked.
        assert {p.name for p in cache.glob("*.safetensors")} == {f"model-{u.name}.safetensors" for u in
                                                                  units_for_range(model_units(conv), s1, e1, 4)}
        for f in cache.glob("*.safetensors"):
            got = mx.load(str(f))
            assert all(mx.array_equal(v, mx.load(str(conv / "model.safetensors"))[k]).item() for k, v in got.items())
        outs2, placed2, _ = run_async(_serve(cfg, prompts), timeout=180)
        assert outs2 == outs and [p[3] for p in placed2] == [0, 0]
    finally:
        for proc, _ in nodes:
            proc.kill()
            proc.wait()


# -- the planner's bits ----------------------------------------------------------------------


def test_recipes_are_mlx_lms():
    from mlx_lm.convert import QUANT_RECIPES

    assert tuple(QUANT_RECIPES) == RECIPES


def test_spec_round_trips_and_refuses_what_mlx_cannot_do():
    spec = QuantSpec("4", 64, ("3", "mixed_3_6", "4"))
    assert wire.quant_from_wire(wire.quant_to_wire(spec)) == spec
    assert wire.quant_from_wire(pb.Quantization()) is None
    assert QuantSpec("4", 64, ("4", "4")).layer_bits is None  # uniform has one spelling
    assert quantized_fingerprint("ab" * 8, spec) != quantized_fingerprint("ab" * 8, QuantSpec("4"))
    for bad in ("7", "16", "mixed_5_9", "four"):
        with pytest.raises(ValueError, match="give one of"):
            QuantSpec.parse(bad)
    with pytest.raises(ValueError, match="group size"):
        QuantSpec("4", 48)


# -- mlxpipe bench quality -----------------------------------------------------------------


def test_bench_quality_scores_every_setting(sources):
    from mlx_lm.utils import load_tokenizer

    from mlxpipe.bench.quality import TEXT, measure

    src = sources("dsv3")
    tokens = load_tokenizer(src).encode(TEXT.read_text())[:96]
    rows = {r["setting"]: r for r in measure(src, ["bf16", "8", "3", "auto"], tokens, 64)}
    ppl = {k: r["perplexity"] for k, r in rows.items()}
    assert all(1 < p < float("inf") for p in ppl.values())
    assert abs(ppl["8"] / ppl["bf16"] - 1) < 0.02  # 8 bits: nearly lossless
    assert rows["3"]["weight_bytes"] < rows["auto"]["weight_bytes"] < rows["8"]["weight_bytes"]
    assert 3 < rows["auto"]["mean_bits"] < 4 and rows["bf16"]["quantization"] == "as stored"


def test_bench_quality_has_a_kv_axis(sources):
    """`bench quality --kv 16,8,4`: the text through a KV cache in chunks, quantized or not;
    at 16 bits that is the one-pass perplexity again."""
    from mlx_lm.utils import load_tokenizer

    from mlxpipe.bench.quality import TEXT, measure, perplexity, widen

    src = sources("llama")  # (head dimension 32: KV groups of 32)
    tokens = load_tokenizer(src).encode(TEXT.read_text())[:97]
    rows = {r["kv_bits"]: r["perplexity"] for r in measure(src, ["bf16"], tokens, 64, (16, 8, 4), 32, 24)}
    from mlx_lm.utils import load_model

    model, _ = load_model(src)
    widen(model)
    assert rows[16] == pytest.approx(perplexity(model, tokens), rel=1e-4)
    assert abs(rows[8] / rows[16] - 1) < 0.01 and rows[4] != rows[16]


def test_bits_on_a_quantized_model_is_refused_before_anything_starts(default_model, sources):
    with pytest.raises(ValueError, match="quantized already"):
        run_async(Cluster(ClusterConfig(model=str(default_model), bits="4")).start())
    with pytest.raises(ValueError, match="--bits auto needs --split auto"):
        run_async(Cluster(ClusterConfig(model=str(sources("llama")), bits="auto", split="even")).start())
