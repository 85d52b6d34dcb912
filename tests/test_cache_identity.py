"""A prefix cache keyed by what was computed: the weights' content, never their names
or sizes (issue 42, finding 1), and tier directories that stay inside the home (finding 6).

The attack as it was made: a copy of the default model whose second stage's
``k_proj`` scales are changed in place (the same files, names and sizes: the same
``fingerprint``) served with the first model's $MLXPIPE_HOME, its disk tier full of
the first model's blocks (``extended``: two servers). In the default run: the digests
themselves (a changed tensor in one stage's range, a re-plan, other bits), the same
attack in one process on one shared disk directory, and symlinks planted in the tier."""

from __future__ import annotations

import logging
import os
import shutil
import stat
from pathlib import Path

import httpx
import mlx.core as mx
import pytest
from inproc import InProcess
from server_proc import ServerProcess

from mlxpipe.proto import pipeline_pb2 as pb
from mlxpipe.server.core.prefix_index import model_salt
from mlxpipe.server.core.scheduler import SchedulerConfig
from mlxpipe.shards.cache.tier_dirs import DIR, tier_root
from mlxpipe.shards.models.digest import WeightsDigest, read_weights
from mlxpipe.shards.models.slicing import load_stage
from mlxpipe.shards.models.store import fingerprint
from mlxpipe.shards.models.weights import read_header
from mlxpipe.shards.params.quant import QuantSpec
from mlxpipe.shards.worker.disk_service import DiskService

SYSTEMS = ["You are a terse geography tutor. Answer with one fact and nothing else, please.",
           "Pretend to be a ship's cook from the eighteenth century who only speaks of soup.",
           "Reply as a patient chess coach. Always suggest one opening and explain it briefly.",
           "Answer every question as a haiku about the weather in early spring in the mountains."]
QUESTION = "Tell me something about rivers, and why people have always built their towns beside them."


def changed_in_place(src: Path, out: Path, layers: range, factor: float = 0.6, what: str = "k_proj.scales") -> Path:
    """A copy of the model folder ``src`` whose ``what`` tensors of ``layers`` are multiplied
    by ``factor``, written over their own bytes: every file keeps its name and size."""
    out.mkdir(parents=True)
    for f in src.iterdir():
        shutil.copy(f, out / f.name)  # (follows the test home's links: a real copy)
    path = out / "model.safetensors"
    header, start = read_header(path)
    names = [n for n in header if n.endswith(what) and any(f".layers.{i}." in n for i in layers)]
    assert len(names) == len(layers)
    tensors = mx.load(str(path))
    with open(path, "r+b") as f:
        for name in names:
            new = (tensors[name] * factor).astype(tensors[name].dtype)
            mx.eval(new)
            lo, hi = header[name]["data_offsets"]
            assert new.nbytes == hi - lo
            f.seek(start + lo)
            f.write(bytes(memoryview(new)))
    return out


def _serve(model: Path, home: Path) -> ServerProcess:
    return ServerProcess("--model", str(model), "--stages", "2", "--split", "even", "--max-tokens", "12",
                         "--temp", "0", "--no-speculate", env=dict(os.environ, MLXPIPE_HOME=str(home)))


def _chats(srv: ServerProcess, **extra):
    """Each chat's answer and its cached prompt tokens (the chats share no block: each
    begins with its own system prompt)."""
    out = []
    for system in SYSTEMS:
        r = httpx.post(f"{srv.base_url}/chat/completions", timeout=300, json={
            "model": "default", "messages": [{"role": "system", "content": system},
                                             {"role": "user", "content": QUESTION}], **extra})
        assert r.status_code == 200, r.text
        body = r.json()
        out.append((body["choices"][0]["message"]["content"], body["usage"]["prompt_tokens_details"]["cached_tokens"]))
    return out


@pytest.mark.extended  # two servers of the default model, twelve chats: CI's second run
def test_a_model_changed_in_place_never_reads_another_models_blocks(default_model, tmp_path):
    home = tmp_path / "home"
    swapped = changed_in_place(default_model, tmp_path / "swapped" / "model", range(15, 30))  # stage 1's layers
    assert fingerprint(swapped) == fingerprint(default_model)  # names and sizes: what the tier was named by
    srv = _serve(default_model, home)
    try:
        first = _chats(srv)
    finally:
        srv.stop()  # (the stages finish writing their blocks)
    assert [cached for _, cached in first] == [0] * 4
    srv = _serve(swapped, home)  # the first model's disk tier, full
    try:
        served = _chats(srv)
        own = _chats(srv, cache_salt="no block of the first model can have this salt")  # its cache-off answers
    finally:
        srv.stop()
    assert [cached for _, cached in own] == [0] * 4
    assert [cached for _, cached in served] == [0] * 4, served
    assert [text for text, _ in served] == [text for text, _ in own]
    assert [text for text, _ in first] != [text for text, _ in own]  # the change matters to what is said
    # Each stage's tier is named by what it loaded: stage 0's layers are the same in both, stage 1's not.
    assert len([d for d in (home / DIR).iterdir() if d.is_dir()]) == 3


# -- the digests ------------------------------------------------------------------------------


def _digests(path: Path, ranges, quant=None):
    out = []
    for start, end in ranges:
        stage, config = load_stage(path, start, end, quant=quant)
        out.append(read_weights(stage).result(config))
    return out


def _salt(digests) -> bytes:
    return model_salt(d.units for d in digests)


KV_A = "kv_a_proj_with_mqa.scales"  # DeepSeek-V3's keys and values come from this projection (MLA)


def test_a_changed_tensor_in_one_stages_range_makes_another_model_however_split(dsv3_model, tmp_path):
    changed = changed_in_place(dsv3_model, tmp_path / "changed", range(3, 4), what=KV_A)
    assert fingerprint(changed) == fingerprint(dsv3_model)
    two, three = _digests(dsv3_model, [(0, 2), (2, 4)]), _digests(dsv3_model, [(0, 1), (1, 2), (2, 4)])
    assert _salt(two) == _salt(three)  # a re-plan keeps the model (and so every block's key)
    assert len({d.stage for d in two + three}) == 4 and two[1].stage == three[2].stage  # a range is a stage's own
    assert three[1].agrees(two[0].units, 1, 2) and not three[1].agrees(two[1].units, 1, 2)
    other = _digests(changed, [(0, 2), (2, 4)])
    assert other[0] == two[0]  # stage 0 loaded the same tensors
    assert other[1].units["layer-00003"] != two[1].units["layer-00003"] and other[1].stage != two[1].stage
    assert {u: d for u, d in other[1].units.items() if u != "layer-00003"} == \
        {u: d for u, d in two[1].units.items() if u != "layer-00003"}
    assert _salt(other) != _salt(two)
    assert sorted(two[0].units) == ["config", "embed", "layer-00000", "layer-00001"]
    assert sorted(two[1].units) == ["config", "head", "layer-00002", "layer-00003"]  # (its head is not tied)
    assert two[0].nbytes > 0 and two[0].nbytes + two[1].nbytes == sum(
        f.stat().st_size - read_header(f)[1] for f in dsv3_model.glob("*.safetensors"))  # every byte, once


def test_other_bits_on_load_make_another_model(sources):
    src = sources("llama")
    four, eight = _digests(src, [(0, 2)], QuantSpec("4")), _digests(src, [(0, 2)], QuantSpec("8"))
    mix = _digests(src, [(0, 2)], QuantSpec("4", layer_bits=("4", "8", "4", "4")))  # as --bits auto may choose
    assert four[0].units["layer-00000"] == mix[0].units["layer-00000"]
    assert four[0].units["layer-00001"] not in (mix[0].units["layer-00001"], eight[0].units["layer-00001"])
    assert len({_salt(four), _salt(eight), _salt(mix)}) == 3


def test_one_disk_directory_never_serves_one_models_blocks_to_another(dsv3_model, reference, tmp_path):
    """Both models' stages write one directory (as a shared tier would): the head's keys,
    salted with what the stages loaded, keep the blocks apart; the first model, served
    again, still finds its own."""
    from mlx_lm.utils import load_tokenizer

    changed = changed_in_place(dsv3_model, tmp_path / "changed", range(3, 4), what=KV_A)
    tok = load_tokenizer(dsv3_model)
    prompt = tok.encode("The rivers of Europe run from the mountains to the sea, and towns grew beside them.")
    config = SchedulerConfig(chunk_size=16, block_tokens=8, prefix_blocks=4096, num_groups=2,
                             prefix_disk_blocks=1 << 16)

    def run(path: Path):
        pipe = InProcess(path, [(0, 2), (2, 4)], config, eos=tok.eos_token_ids, disk=tmp_path / "disk")
        (out,), (seq,) = pipe.generate([prompt], 8)
        pipe.close()
        return out, seq.cached_tokens, seq.disk_tokens

    assert run(dsv3_model) == (reference(dsv3_model, prompt, 8), 0, 0)
    assert run(changed) == (reference(changed, prompt, 8), 0, 0)
    whole = (len(prompt) - 1) // 8 * 8
    assert run(dsv3_model) == (reference(dsv3_model, prompt, 8), whole, whole)  # from disk: its own blocks


# -- tier directories: real, inside the home, owner-only --------------------------------------


def _block(value: float):
    a = mx.full((1, 2, 4, 64), value)
    mx.eval(a)
    return {"kv": {0: (a, a)}, "state": None}


def _mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def test_a_symlinked_tier_directory_is_refused_and_files_are_owner_only(tmp_path, monkeypatch, caplog):
    home, outside = tmp_path / "home", tmp_path / "outside"
    monkeypatch.setenv("MLXPIPE_HOME", str(home))
    outside.mkdir()
    (outside / "keep.txt").write_text("not the tier's")
    weights = WeightsDigest({"config": "c", "layer-00000": "0", "layer-00001": "1"})
    load = pb.LoadRequest(start=0, end=2, block_tokens=4)
    root = tier_root(home, weights.stage, 4)
    root.parent.parent.mkdir(parents=True)
    root.parent.symlink_to(outside, target_is_directory=True)  # the stage's directory points out of the home
    service = DiskService(1 << 20)
    with caplog.at_level(logging.WARNING, logger="mlxpipe.shards.worker.disk_service"):
        assert service.for_load(load, weights) is None
    assert "is a symlink" in caplog.text
    assert [p.name for p in outside.iterdir()] == ["keep.txt"]
    root.parent.unlink()
    (home / DIR).chmod(0o755)  # one of ours that is looser: tightened
    root.mkdir(parents=True)
    (root / "w0").symlink_to(outside, target_is_directory=True)  # a writer's directory out of the home
    tier = service.for_load(load, weights)
    assert tier.dir == root / "w1"
    for d in (home / DIR, root.parent, root, tier.dir):
        assert _mode(d) == 0o700, d
    key = 7
    (tier.dir / f".tmp-{key:016x}").symlink_to(outside / "keep.txt")  # a write's temporary file, planted
    tier.put(key, _block(1.0), False, 0)
    assert tier.flush()
    written = [f for f in tier.dir.iterdir() if f.name.endswith(".safetensors")]
    assert len(written) == 1 and all(_mode(f) == 0o600 for f in tier.dir.iterdir())
    assert _mode(root.parent / "units.json") == 0o600
    link = tier.dir / written[0].name.replace(f"{key:016x}", f"{key + 1:016x}")
    link.symlink_to(outside / "keep.txt")  # a block named like one, pointing out
    tier.retarget(0, 2, 1 << 20)
    assert tier.blocks() == ([key], [])  # never indexed, so never read nor deleted
    service.close()
    assert [p.name for p in outside.iterdir()] == ["keep.txt"] and (outside / "keep.txt").read_text() == \
        "not the tier's"
