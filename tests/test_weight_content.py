"""Weights known by their content, not by names and sizes (issue 42): a head whose model
changed in place sends the changed unit again, a node's own copy that is not the head's
is never loaded in its place, quantized units follow their source's content, and a
restart hashes nothing that did not change."""

from __future__ import annotations

import shutil
import time

import pytest
from conftest import SECRET, node_process, run_async, stage_stub

from mlxpipe.proto import pipeline_pb2 as pb
from mlxpipe.proto.rpc import Security
from mlxpipe.server.cluster.assembly import Cluster
from mlxpipe.server.cluster.stage_client import Pipeline
from mlxpipe.server.cluster.weights import QuantizedSource, WeightSource, _holds
from mlxpipe.server.config import ClusterConfig
from mlxpipe.server.core.streams import collect
from mlxpipe.server.core.transport import PipelineError
from mlxpipe.shards.models import unit_digests
from mlxpipe.shards.models.store import fingerprint
from mlxpipe.shards.models.weights import CHUNK_BYTES, model_units, read_header
from mlxpipe.shards.params.quant import QuantSpec

PROMPT = [5, 77, 901, 33, 12]
TOKENS = 16
FLOATS = {"F16": 2, "BF16": 2, "F32": 4}  # safetensors dtypes, bytes a value


def flip_signs(folder, tensor: str) -> None:
    """Negate every value of a float tensor of ``folder`` in place: the same names, sizes
    and files, other weights (as a fine-tune or a re-quantization in place does)."""
    for path in folder.glob("*.safetensors"):
        header, start = read_header(path)
        if tensor in header:
            info = header[tensor]
            size = FLOATS[info["dtype"]]
            begin, end = info["data_offsets"]
            with open(path, "r+b") as f:
                f.seek(start + begin)
                data = bytearray(f.read(end - begin))
                data[size - 1::size] = bytes(b ^ 0x80 for b in data[size - 1::size])  # each value's sign bit
                f.seek(start + begin)
                f.write(data)
            return
    raise AssertionError(f"no tensor {tensor} in {folder}")


def scales_of(folder, layer: int) -> str:
    """A float tensor of ``layer`` that shapes its output (of its attention's output projection)."""
    for path in sorted(folder.glob("*.safetensors")):
        for name, info in read_header(path)[0].items():
            if f"layers.{layer}.self_attn.o_proj." in name and info.get("dtype") in FLOATS:
                return name
    raise AssertionError(f"no float tensor of layer {layer}'s o_proj in {folder}")


async def _serve_once(model: str, address: str):
    cfg = ClusterConfig(model=model, nodes=[address], split="even", security=Security(secret=SECRET))
    cluster = await Cluster(cfg).start()
    try:
        out = [t.id for t in await collect(cluster.engine.submit(PROMPT, TOKENS))]
        return out, cluster.pipeline.stages[0].weights_sent
    finally:
        await cluster.stop()


def test_changed_weights_travel_again_and_a_nodes_own_copy_is_not_taken_by_name(dsv3_model, tmp_path, reference,
                                                                                monkeypatch):
    """The attack as made: a node holds its own copy of the model, the same names and sizes
    but one layer's weights changed; it is not trusted (`local`): it receives the head's
    units and serves the head's model. Then the head's folder changes in place (another
    layer, same names and sizes): the node, holding the old received units, is sent that
    unit again, only that, and serves the new model's tokens (mlx-lm's on the new folder)."""
    head, node_models = tmp_path / "head", tmp_path / "node-models"
    shutil.copytree(dsv3_model, head / "tiny")
    shutil.copytree(dsv3_model, node_models / "tiny")
    flip_signs(node_models / "tiny", scales_of(dsv3_model, 2))
    assert reference(node_models / "tiny", PROMPT, TOKENS) != reference(dsv3_model, PROMPT, TOKENS)
    units = model_units(dsv3_model)
    monkeypatch.chdir(head)  # the head serves "tiny" from here; the node finds its own "tiny"
    proc, address = node_process(tmp_path / "home", "--models-dir", str(node_models))
    try:
        out, sent = run_async(_serve_once("tiny", address), timeout=180)
        assert out == reference(dsv3_model, PROMPT, TOKENS)
        assert sent == sum(u.data_bytes for u in units.values())  # its own copy served nothing

        flip_signs(head / "tiny", scales_of(dsv3_model, 1))
        assert fingerprint(head / "tiny") == fingerprint(dsv3_model)  # the name cannot tell
        changed = shutil.copytree(head / "tiny", tmp_path / "changed")  # (mlx-lm's tokens on the new folder)
        out2, sent2 = run_async(_serve_once("tiny", address), timeout=180)
        assert out2 == reference(changed, PROMPT, TOKENS) != out
        assert sent2 == units["layer-00001"].data_bytes
    finally:
        proc.kill()
        proc.wait()
    log = proc.stderr.read()
    assert "not the head's copy (layer-00002 differs)" in log, log


def test_a_node_answers_local_only_for_the_content_offered(dsv3_model, tmp_path):
    """`Have` straight to a node holding a copy: `local` (naming its digests) for the head's
    units and for the head's source of quantized units while the copy is the head's; once
    one tensor of it changes in place, or the head's config differs, it asks for every unit."""
    models = tmp_path / "models"
    shutil.copytree(dsv3_model, models / "tiny")
    source = WeightSource(dsv3_model, fingerprint(dsv3_model), 4)
    units = source.range_units(0, 2)
    digests = source.digests(units)
    offer = pb.WeightsOffer(model="tiny", fingerprint="ab" * 8, start=0, end=2, chunk_bytes=CHUNK_BYTES,
                            files=source.files, units=[pb.WeightUnit(name=u.name, header=u.header(),
                                                                     data_bytes=u.data_bytes, digest=digests[u.name])
                                                       for u in units])
    quantized = pb.WeightsOffer(model="tiny", fingerprint="cd" * 8, start=0, end=2, source_fingerprint="ab" * 8,
                                source_digests=digests | source.file_digests(), files=source.files)
    other_config = pb.WeightsOffer()
    other_config.CopyFrom(offer)
    other_config.files["config.json"] = source.files["config.json"].replace(b"2048", b"1024")
    proc, address = node_process(tmp_path / "home", "--models-dir", str(models))
    try:
        stub = stage_stub(address)
        for o in (offer, quantized):
            need = stub.Have(o, timeout=60)
            assert need.local and dict(need.local_digests) == digests | source.file_digests()
        need = stub.Have(other_config, timeout=60)
        assert not need.local and [u.name for u in need.units] == [u.name for u in units]
        flip_signs(models / "tiny", scales_of(dsv3_model, 1))
        for o in (offer, quantized):
            assert not stub.Have(o, timeout=60).local
        assert [u.name for u in stub.Have(offer, timeout=60).units] == [u.name for u in units]
    finally:
        proc.kill()
        proc.wait()


def test_digests_are_kept_while_files_hold_and_made_again_when_they_change(dsv3_model, tmp_path, monkeypatch):
    """A restart hashes nothing unchanged; a change in place (same names and sizes) is
    hashed again, that unit only; a copy elsewhere of the same tensors has the same digests."""
    monkeypatch.setattr(unit_digests, "RACY_NS", 100_000_000)
    model = shutil.copytree(dsv3_model, tmp_path / "model")
    hashed = []
    real = unit_digests.submit_unit
    monkeypatch.setattr(unit_digests, "submit_unit", lambda unit: hashed.append(unit.name) or real(unit))
    units = model_units(model)
    time.sleep(0.2)  # (files older than RACY_NS are kept)
    first = unit_digests.unit_digests(tmp_path / "home", model, units)
    assert sorted(hashed) == sorted(units) and first == unit_digests.unit_digests(tmp_path / "other", dsv3_model,
                                                                                  model_units(dsv3_model))
    hashed.clear()
    assert unit_digests.unit_digests(tmp_path / "home", model, model_units(model)) == first and hashed == []
    flip_signs(model, scales_of(model, 3))
    time.sleep(0.2)
    again = unit_digests.unit_digests(tmp_path / "home", model, model_units(model))
    assert sorted(hashed) == sorted(units)  # every unit of the file that changed (one file holds all here)
    assert {u for u in units if again[u] != first[u]} == {"layer-00003"}
    hashed.clear()
    assert unit_digests.unit_digests(tmp_path / "home", model, model_units(model)) == again and hashed == []


def test_quantized_units_follow_their_sources_content(sources, tmp_path, monkeypatch):
    """The head's quantized units are kept under the source's content and the spec: a source
    changed in place (same fingerprint) is quantized afresh, never served from the old units."""
    monkeypatch.setenv("MLXPIPE_HOME", str(tmp_path / "head"))
    src = shutil.copytree(sources("dsv3"), tmp_path / "src")
    spec = QuantSpec("4")
    old = QuantizedSource(WeightSource(src, fingerprint(src), 4), spec)
    try:
        before = old.digests(old.range_units(1, 2))
    finally:
        old.close()
    flip_signs(src, scales_of(src, 1))
    new = QuantizedSource(WeightSource(src, fingerprint(src), 4), spec)
    try:
        assert new.fingerprint == old.fingerprint and new.folder != old.folder
        after = new.digests(new.range_units(1, 2))
    finally:
        new.close()
    assert after["layer-00001"] != before["layer-00001"]


def test_the_head_refuses_a_node_whose_copy_is_not_its_own():
    """A `local` answer must name the digests offered (an older node answers by name);
    stages must agree where their units meet (the config, a tied embedding)."""
    offered = {"layer-00000": "a" * 64, "config.json": "c" * 64}
    assert _holds(pb.WeightsNeed(local=True, local_digests=offered), offered, 0, "n:1") == 0
    for said, why in (({}, "named no digests"), (dict(offered, **{"layer-00000": "b" * 64}), "layer-00000 differs")):
        with pytest.raises(PipelineError, match=why):
            _holds(pb.WeightsNeed(local=True, local_digests=said), offered, 0, "n:1")

    async def check(replies):
        pipeline = Pipeline(["127.0.0.1:1", "127.0.0.1:2"], "tiny")  # (nothing dialled)
        try:
            pipeline._check_digests(replies)
        finally:
            await pipeline.close()

    same = [pb.LoadReply(unit_digests={"config": "c" * 64, f"layer-0000{i}": f"{i}" * 64}) for i in range(2)]
    run_async(check(same))
    same[1].unit_digests["config"] = "d" * 64
    with pytest.raises(PipelineError, match=r"node 127.0.0.1:2 \(stage 1\) loaded another config than stage 0"):
        run_async(check(same))
