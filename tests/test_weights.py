"""Nodes without the model: weights streamed from the head, resumable and
checksummed; nodes that join a head."""

from __future__ import annotations

import asyncio
import hashlib
import signal
import subprocess
import sys
import threading
import time

import pytest
from conftest import SECRET, node_process, run_async

from mlxpipe.proto.rpc import Security
from mlxpipe.server.cluster import weights
from mlxpipe.server.cluster.assembly import Cluster
from mlxpipe.server.config import ClusterConfig
from mlxpipe.server.core.streams import collect
from mlxpipe.shards.models.received import Receiver
from mlxpipe.shards.models.unit_digests import hash_file, hash_unit
from mlxpipe.shards.models.weights import CHUNK_BYTES, WeightsError, model_units, read_header, units_for_range

PROMPT = [5, 77, 901, 33, 12]
TOKENS = 20


# -- units and the receiver (no network) -------------------------------------------------


def test_units_cover_every_tensor_once_and_read_back_exactly(dsv3_model):
    units = model_units(dsv3_model)
    header, start = read_header(dsv3_model / "model.safetensors")
    names = sorted(n for n in header if n != "__metadata__")
    assert sorted(t.name for u in units.values() for t in u.tensors) == names
    assert set(units) == {"embed", "head"} | {f"layer-{i:05d}" for i in range(4)}
    raw = (dsv3_model / "model.safetensors").read_bytes()
    for u in units.values():
        data = b"".join(u.read(i, 1 << 16) for i in range(u.chunks(1 << 16)))
        assert data == b"".join(raw[t.offset:t.offset + t.nbytes] for t in u.tensors)
    middle = units_for_range(units, 1, 3, 4)
    assert [u.name for u in middle] == ["layer-00001", "layer-00002"]
    last = units_for_range(units, 3, 4, 4)
    assert [u.name for u in last] == ["layer-00003", "head"]  # its own lm_head: no embedding


def test_receiver_verifies_resumes_and_refuses_strange_names(dsv3_model, tmp_path):
    unit = model_units(dsv3_model)["embed"]
    chunk = 1 << 18
    digest = hash_unit(unit)
    rx = Receiver(tmp_path, chunk_bytes=chunk)
    missing = rx.need("embed", digest, unit.header(), unit.data_bytes)
    assert missing == list(range(unit.chunks(chunk))) and len(missing) > 3
    first = unit.read(0, chunk)
    assert not rx.write_chunk("embed", digest, 0, b"x" + first[1:], hashlib.sha256(first).digest())  # corrupted
    assert rx.write_chunk("embed", digest, 0, first, hashlib.sha256(first).digest())
    # A new Receiver (a restarted node) sees what arrived and verified.
    again = Receiver(tmp_path, chunk_bytes=chunk)
    assert again.need("embed", digest, unit.header(), unit.data_bytes) == missing[1:]
    assert again.verified_bytes([digest]) == chunk
    for i in missing[1:]:
        data = unit.read(i, chunk)
        assert again.write_chunk("embed", digest, i, data, hashlib.sha256(data).digest())
    # Kept under its content digest: the file's own digest is the one offered.
    kept = again.dir / f"{digest}.safetensors"
    assert kept.exists() and not list(again.dir.glob("*.partial")) and hash_file(kept) == digest
    header, _ = read_header(kept)
    assert set(header) - {"__metadata__"} == {t.name for t in unit.tensors}
    for bad in ("../../etc/passwd", "layer-1", "EMBED"):
        with pytest.raises(WeightsError):
            again.need(bad, digest, b"{}", 1)
    for bad in ("../x", "ab" * 8, ""):
        with pytest.raises(WeightsError):
            again.need("embed", bad, unit.header(), unit.data_bytes)


def test_a_unit_that_is_not_its_digest_is_never_kept(dsv3_model, tmp_path):
    """Chunks that pass their checksums but do not make the digest offered (the head's copy
    changed while it was sent) are dropped when the last arrives, in 4 MiB chunks (digest
    from the chunks' checksums) as in others (hashed again)."""
    unit = model_units(dsv3_model)["layer-00001"]
    for chunk in (CHUNK_BYTES, 1 << 16):
        rx = Receiver(tmp_path / str(chunk), chunk_bytes=chunk)
        wrong = "0" * 64
        with pytest.raises(WeightsError, match="not the 0000000000000000 offered"):
            for i in rx.need("layer-00001", wrong, unit.header(), unit.data_bytes):
                data = unit.read(i, chunk)
                rx.write_chunk("layer-00001", wrong, i, data, hashlib.sha256(data).digest())
        assert not rx.has(wrong) and not list(rx.dir.iterdir())
        right = hash_unit(unit)
        for i in rx.need("layer-00001", right, unit.header(), unit.data_bytes):
            data = unit.read(i, chunk)
            assert rx.write_chunk("layer-00001", right, i, data, hashlib.sha256(data).digest())
        assert rx.has(right)


# -- over the wire -------------------------------------------------------------------


def _node(home, *args, secret=SECRET):
    return node_process(home, *args, secret=secret)


def _range_bytes(model, start, end):
    return sum(u.data_bytes for u in units_for_range(model_units(model), start, end, 4))


async def _generate(model, nodes, **kw):
    cfg = ClusterConfig(model=str(model), nodes=nodes, split="even", security=Security(secret=SECRET), **kw)
    cluster = await Cluster(cfg).start()
    try:
        out = [t.id for t in await collect(cluster.engine.submit(PROMPT, TOKENS))]
        return out, [(st.start, st.end, st.weights_sent) for st in cluster.pipeline.stages], cluster.weights
    finally:
        await cluster.stop()


def test_empty_nodes_receive_exactly_their_ranges(dsv3_model, tmp_path, reference):
    nodes = [_node(tmp_path / f"home{i}") for i in range(2)]
    try:
        out, stages, _ = run_async(_generate(dsv3_model, [a for _, a in nodes]), timeout=180)
        assert out == reference(dsv3_model, PROMPT, TOKENS)
        total = sum(u.data_bytes for u in model_units(dsv3_model).values())
        for start, end, sent in stages:
            assert sent == _range_bytes(dsv3_model, start, end) < total
        # Next time, the cache serves: nothing moves.
        out2, stages2, _ = run_async(_generate(dsv3_model, [a for _, a in nodes]), timeout=180)
        assert out2 == out and [s for _, _, s in stages2] == [0, 0]
    finally:
        for proc, _ in nodes:
            proc.kill()
            proc.wait()


def test_a_corrupted_chunk_is_sent_again(dsv3_model, tmp_path, reference):
    nodes = [_node(tmp_path / f"home{i}") for i in range(2)]
    try:
        async def main():
            cfg = ClusterConfig(model=str(dsv3_model), nodes=[a for _, a in nodes], split="even",
                                security=Security(secret=SECRET))
            cluster = Cluster(cfg)
            # Garble the first chunk of layer 1 once, as if a bit flipped on the way.
            original, garbled = weights.chunk_message, []

            def with_fault(source, unit, index, data):
                message = original(source, unit, index, data)
                if (unit, index) == ("layer-00001", 0) and not garbled:
                    garbled.append(message)
                    message.data = bytes([data[0] ^ 0xFF]) + data[1:]
                return message

            weights.chunk_message = with_fault
            try:
                await cluster.start()
            finally:
                weights.chunk_message = original
            try:
                out = [t.id for t in await collect(cluster.engine.submit(PROMPT, TOKENS))]
                return out, [(st.start, st.end, st.weights_sent) for st in cluster.pipeline.stages]
            finally:
                await cluster.stop()

        out, stages = run_async(main(), timeout=180)
        assert out == reference(dsv3_model, PROMPT, TOKENS)
        layer1 = model_units(dsv3_model)["layer-00001"]
        resent = min(CHUNK_BYTES, layer1.data_bytes)
        (s0, e0, sent0), (s1, e1, sent1) = stages
        holder = 0 if s0 <= 1 < e0 else 1
        assert [sent0, sent1][holder] == _range_bytes(dsv3_model, *[(s0, e0), (s1, e1)][holder]) + resent
    finally:
        for proc, _ in nodes:
            proc.kill()
            proc.wait()


def test_an_interrupted_transfer_resumes_without_resending(dsv3_model, tmp_path, reference):
    home = tmp_path / "home"
    digests = [hash_unit(u) for u in units_for_range(model_units(dsv3_model), 0, 4, 4)]
    proc, address = _node(home)
    total = _range_bytes(dsv3_model, 0, 4)
    try:
        async def slow_start():  # 1 stage, slow enough to be killed halfway
            cfg = ClusterConfig(model=str(dsv3_model), nodes=[address], split="even",
                                security=Security(secret=SECRET), weights_rate=total / 6)
            await Cluster(cfg).start()

        async def kill_halfway():
            task = asyncio.ensure_future(slow_start())
            rx = Receiver(home)
            while True:
                await asyncio.sleep(0.1)
                done = rx.verified_bytes(digests)
                if done > total * 0.3:
                    proc.send_signal(signal.SIGKILL)
                    break
            with pytest.raises(Exception):
                await task
            return done

        run_async(kill_halfway(), timeout=120)
        proc.wait()
        verified = Receiver(home).verified_bytes(digests)
        assert 0 < verified < total
        proc2, address2 = _node(home)
        try:
            out, stages, _ = run_async(_generate(dsv3_model, [address2]), timeout=180)
            assert out == reference(dsv3_model, PROMPT, TOKENS)
            assert stages[0][2] == total - verified, "only what had not arrived and verified is sent"
        finally:
            proc2.kill()
            proc2.wait()
    finally:
        if proc.poll() is None:
            proc.kill()


# -- joining ---------------------------------------------------------------------------


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _await_listening(port, starter, timeout=240):
    """Until something accepts connections on loopback ``port`` (or ``starter`` gave up)."""
    import socket

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and starter.is_alive():
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise AssertionError(f"nothing listens on 127.0.0.1:{port}: the head did not start taking joins")


def _text(model, prompt, tokens):
    """What the API's completion text is for ``tokens`` after ``prompt``: the text they
    add to the prompt's (a first token's leading space included)."""
    from mlx_lm.utils import load_tokenizer

    tok = load_tokenizer(model)
    return tok.decode(prompt + tokens)[len(tok.decode(prompt)):]


def test_nodes_join_a_head_and_a_wrong_secret_is_refused(dsv3_model, tmp_path, reference):
    import httpx
    from server_proc import ServerProcess

    port = _free_port()
    secret_file = tmp_path / "secret"
    secret_file.write_text(SECRET)
    joiners = []
    box = {}
    try:
        # The head waits for two nodes; they dial in.
        starter = threading.Thread(target=lambda: box.setdefault("srv", ServerProcess(
            "--model", str(dsv3_model), "--join-listen", f"127.0.0.1:{port}", "--wait-nodes", "2",
            "--secret-file", str(secret_file), "--split", "even", timeout=240)))
        starter.start()
        _await_listening(port, starter)  # the head takes joins once its model is loaded
        for i in range(2):
            joiners.append(_node(tmp_path / f"home{i}", "--join", f"127.0.0.1:{port}"))
        starter.join(240)
        head = box["srv"]
        listed = httpx.get(f"{head.root}/nodes", timeout=10).json()["nodes"]
        assert sorted(n["address"] for n in listed) == sorted(a for _, a in joiners)
        assert all(n["in_plan"] for n in listed) and all(n["memory_bytes"] > 0 for n in listed)
        r = httpx.post(f"{head.base_url}/completions", json={"model": "default", "prompt": PROMPT,
                                                              "max_tokens": TOKENS, "temperature": 0}, timeout=120)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == TOKENS
        assert r.json()["choices"][0]["text"] == _text(dsv3_model, PROMPT, reference(dsv3_model, PROMPT, TOKENS))
        out = subprocess.run([sys.executable, "-m", "mlxpipe.server.cli", "nodes", "--url", head.base_url],
                             capture_output=True, text=True, timeout=60)
        assert all(a in out.stdout for _, a in joiners)
        # A node with the wrong secret is refused and says so.
        intruder, _ = _node(tmp_path / "intruder", "--join", f"127.0.0.1:{port}",
                            secret="not-the-cluster-secret-at-all")
        assert intruder.wait(timeout=60) != 0
        assert "refused this node" in intruder.stderr.read()
        assert len(httpx.get(f"{head.root}/nodes", timeout=10).json()["nodes"]) == 2
    finally:
        if "srv" in box:
            box["srv"].stop()
        for proc, _ in joiners:
            proc.kill()
            proc.wait()
