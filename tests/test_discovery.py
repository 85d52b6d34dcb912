"""What a head that discovers its nodes dials, and what it shows, when strangers announce:
announcements of another cluster, off the head's networks, or pointing at the head's own
sockets get no connection (counted by listeners the test owns); one that claims this
cluster's id is asked `Hello` once, first, and never sent the secret; a node that stops
proving the secret is dropped; every field is checked and shown escaped; a head waiting
for nodes says what it saw and what to check, once.

The first tests hand announcements to a real ``Discovery`` in this process (no multicast;
real sockets, real gRPC peers); the last forges them with DNS-SD on a LAN of network
namespaces against `mlxpipe serve --discover` (extended: needs root)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from conftest import SECRET, run_async, until
from netns import Lan, available

from mlxpipe.proto import pipeline_pb2 as pb
from mlxpipe.proto.rpc import Security
from mlxpipe.server.cli.nodes import _found_rows
from mlxpipe.server.cluster.admission import local_networks
from mlxpipe.server.cluster.discovery import Discovery
from mlxpipe.shards.net import hello
from mlxpipe.shards.net.announce import Fields, properties, read

OURS = hello.cluster_id(SECRET)
OTHER = hello.cluster_id("another-cluster-secret-0123456789")
FORGED_NAME = "evil\x1b[31mRED\nFORGED LOG LINE: node ok"
TESTS = Path(__file__).parent


def test_an_announcements_fields_are_checked_and_shown_escaped():
    fields, skipped = read({k.encode(): v.encode() for k, v in properties("mac-1", 64 << 30, SECRET).items()})
    assert not skipped and fields.name == "mac-1" and fields.memory_bytes == 64 << 30 and fields.cluster_id == OURS
    assert fields.versions == hello.versions()
    fields, skipped = read({b"name": FORGED_NAME.encode(), b"mem": b"abc", b"cid": b"not-an-id", b"chip": b"c" * 64,
                            b"ver": b"\xff\xfe", b"mlx": None, b"other\x1b": b"\x1b", b"mlxlm": "1.0\u202e".encode()})
    assert fields == Fields()  # nothing usable, and nothing raised
    assert sorted(skipped) == sorted([
        "field name skipped: not printable text: 'evil\\x1b[31mRED\\nFORGED LOG LINE: node ok'",
        "field mem skipped: not a number of bytes: 'abc'",
        "field cid skipped: not a cluster id (16 hex digits): 'not-an-id'",
        f"field chip skipped: longer than 63 characters: '{'c' * 40}...'",
        "field ver skipped: not UTF-8 text: b'\\xff\\xfe'",
        "field mlx skipped: no value",
        "field mlxlm skipped: not printable text: '1.0\\u202e'"]), skipped
    assert all(line.isprintable() for line in skipped)
    row = _found_rows([{"name": "", "instance": "x\x1b[2J\ny", "address": "a\nb", "cluster": "this", "usable": False,
                        "why": "w\x1b", "memory_bytes": 0, "chip": "c\u202e", "versions": {"mlxpipe": "\n"}}])[1]
    assert all(cell.isprintable() for cell in row) and row[0] == "x\\x1b[2J\\ny", row


class FakePeer(grpc.GenericRpcHandler):
    """A gRPC listener on loopback that records every call (method, metadata) and answers
    ``Hello`` (with a valid proof of ``SECRET`` while ``proves``); anything else UNAUTHENTICATED."""

    def __init__(self, proves: bool):
        self.proves, self.calls = proves, []
        self.server = grpc.aio.server()
        self.server.add_generic_rpc_handlers((self,))
        self.port = self.server.add_insecure_port("127.0.0.1:0")

    def service(self, details):
        self.calls.append((details.method, dict(details.invocation_metadata)))
        if details.method == "/mlxpipe.v1.Stage/Hello":
            return grpc.unary_unary_rpc_method_handler(self._hello, pb.HelloRequest.FromString,
                                                       pb.HelloReply.SerializeToString)
        return grpc.unary_unary_rpc_method_handler(self._refuse)

    async def _hello(self, request, context):
        md, v = dict(context.invocation_metadata()), hello.versions()
        reply = pb.HelloReply(name="fake", chip="fake", memory_bytes=1 << 30, mlxpipe_version=v["mlxpipe"],
                              mlx_version=v["mlx"], mlx_lm_version=v["mlx_lm"], time_s=time.time(), cluster=OURS)
        if self.proves:
            reply.proof = hello.proof(SECRET, bytes.fromhex(md[hello.NONCE_KEY]), md[hello.DIALLED_KEY])
        return reply

    async def _refuse(self, request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "no")

    def secrets_sent(self) -> list:
        return [m for m, md in self.calls if "authorization" in md or any(SECRET in str(v) for v in md.values())]


async def _counting_listener(host: str, counts: dict, label: str):
    def accepted(reader, writer):
        counts[label] = counts.get(label, 0) + 1
        writer.close()

    server = await asyncio.start_server(accepted, host, 0)
    return server, server.sockets[0].getsockname()[1]


def test_only_this_clusters_on_link_announcements_are_dialled_and_asked_for_proof_first(caplog):
    caplog.set_level(logging.DEBUG)
    lan_ip = next((str(n.ip) for _, n in local_networks() if not n.ip.is_loopback), None)

    async def go():
        counts: dict = {}
        another, another_port = await _counting_listener("127.0.0.1", counts, "another")
        no_id, no_id_port = await _counting_listener("127.0.0.1", counts, "no id")
        own, own_port = await _counting_listener("0.0.0.0", counts, "own")  # plays the head's HTTP socket
        stranger = FakePeer(proves=False)
        await stranger.server.start()
        d = await Discovery(Security(secret=SECRET), listening=[("0.0.0.0", own_port)],
                            check_every=0.1).start(browse=False)
        forged, skipped = read({b"cid": OURS.encode(), b"name": FORGED_NAME.encode(), b"mem": b"abc"})
        announced = [("another", ["127.0.0.1"], another_port, Fields(name="other", cluster_id=OTHER), ()),
                     ("no id", ["127.0.0.1"], no_id_port, Fields(name="old"), ()),
                     ("own", ["127.0.0.1"], own_port, Fields(name="self", cluster_id=OURS), ()),
                     ("far", ["203.0.113.7"], 50051, Fields(name="far", cluster_id=OURS), ()),
                     ("stranger\u202e", ["203.0.113.8", "127.0.0.1"], stranger.port, forged, skipped)]
        if lan_ip is not None:
            announced.append(("own lan", [lan_ip], own_port, Fields(name="self2", cluster_id=OURS), ()))
        try:
            for instance, hosts, port, fields, said in announced:
                await d.take(f"{instance}._mlxpipe._tcp.local.", hosts, port, fields, said)
            await asyncio.sleep(1.5)  # 15 watch intervals
            for instance, hosts, port, fields, said in announced:  # heard again: nothing new
                await d.take(f"{instance}._mlxpipe._tcp.local.", hosts, port, fields, said)
            await asyncio.sleep(0.5)
            return (counts, stranger.calls, stranger.secrets_sent(), {r["instance"]: r for r in d.table()}, d.usable(),
                    own_port, stranger.port)
        finally:
            await d.stop()
            await stranger.server.stop(None)
            for s in (another, no_id, own):
                s.close()

    counts, calls, secrets_sent, table, usable, own_port, stranger_port = run_async(go(), timeout=60)
    assert counts == {}, counts  # not one connection to any of them
    assert [m for m, _ in calls] == ["/mlxpipe.v1.Stage/Hello"] and not secrets_sent, calls  # once, and first
    assert usable == []
    why = {k: v["why"] for k, v in table.items()}
    assert why["another"].startswith("another cluster") and why["no id"] == "it announces no cluster id", why
    assert why["own"] == f"127.0.0.1:{own_port} is this head's own listening socket", why
    assert why["far"] == "203.0.113.7:50051 is not on a network this machine is on", why
    assert why["stranger\\u202e"] == f"it answers without proof of this cluster's secret for 127.0.0.1:{stranger_port}"
    if lan_ip is not None:
        assert why["own lan"] == f"{lan_ip}:{own_port} is this head's own listening socket", why
    messages = [r.getMessage() for r in caplog.records if r.name.startswith("mlxpipe")]
    assert all(m.isprintable() for m in messages), [m for m in messages if not m.isprintable()]
    name_lines = [m for m in messages if "field name skipped" in m]
    assert name_lines == ["announcement stranger\\u202e: field name skipped: not printable text: "
                          "'evil\\x1b[31mRED\\nFORGED LOG LINE: node ok'"], name_lines
    assert len([m for m in messages if "field mem skipped: not a number of bytes: 'abc'" in m]) == 1, messages
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], messages


def test_a_found_node_proves_the_secret_at_every_check_and_is_dropped_when_it_stops(caplog):
    async def go():
        node, usable, gone = FakePeer(proves=True), [], []
        await node.server.start()

        async def on_usable(found):
            usable.append(found.address)
            raise ValueError("a callback that fails \x1b[2J")  # logged, escaped; discovery goes on

        async def on_gone(found):
            gone.append(found.address)

        d = await Discovery(Security(secret=SECRET), on_usable, on_gone, check_every=0.1).start(browse=False)
        address = f"127.0.0.1:{node.port}"
        try:
            await d.take("good._mlxpipe._tcp.local.", ["127.0.0.1"], node.port, Fields(name="good", cluster_id=OURS))
            assert d.usable() == [address]
            await until(lambda: len(node.calls) >= 6, 10, "the node asked Hello again each interval")
            assert usable == [address]
            nonces = [md[hello.NONCE_KEY] for _, md in node.calls]
            assert len(set(nonces)) == len(nonces), nonces  # each check a fresh question
            node.proves = False  # another process took its address
            await until(lambda: gone == [address], 10, "the node that stopped proving dropped")
            asked = len(node.calls)
            await asyncio.sleep(0.5)
            return d.usable(), node.calls, asked, node.secrets_sent(), d.table()
        finally:
            await d.stop()
            await node.server.stop(None)

    usable, calls, asked, secrets_sent, table = run_async(go(), timeout=60)
    assert usable == [] and not secrets_sent and {m for m, _ in calls} == {"/mlxpipe.v1.Stage/Hello"}
    assert len(calls) == asked  # not asked again
    assert table[0]["why"].endswith("no longer proves it holds this cluster's secret"), table
    failed = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert failed == ["discovery: ValueError: a callback that fails \\x1b[2J"], failed


def test_a_head_waiting_for_nodes_says_what_it_saw_and_what_to_check_once(caplog):
    caplog.set_level(logging.WARNING, logger="mlxpipe.server.cluster.discovery")

    def hints():
        return [r.getMessage() for r in caplog.records if r.getMessage().startswith("still looking")]

    async def go():
        d = await Discovery(Security(secret=SECRET), check_every=0.05, hint_after=0.3).start(browse=False)
        waiting = asyncio.ensure_future(d.wait(1))
        try:
            await asyncio.sleep(1.0)  # the hint, then 14 intervals with nothing new
            first = hints()
            await d.take("x._mlxpipe._tcp.local.", ["127.0.0.1"], 50051, Fields(name="x", cluster_id=OTHER))
            await asyncio.sleep(0.5)
            return first, hints()
        finally:
            waiting.cancel()
            await d.stop()

    first, both = run_async(go(), timeout=30)
    assert len(first) == 1, first
    assert "0 of 1 found; no node has announced itself here at all" in first[0], first
    assert "`mlxpipe node --announce`" in first[0] and "multicast DNS (UDP port 5353)" in first[0], first
    assert len(both) == 2, both  # said again once, because something changed
    assert "Seen: x at 127.0.0.1:50051: another cluster" in both[1], both
    assert "the same --secret-file or $MLXPIPE_SECRET" in both[1] and "--announce" in both[1], both


# -- on a LAN of network namespaces, against `mlxpipe serve --discover` ---------------------------

HTTP_PORT = 18080


def _accepts(lines: list, where: str) -> int:
    return sum(line.strip() == f"accept {where}" for line in list(lines))


def _queued(lan: Lan, port: int) -> int:
    """Connections the head's HTTP socket holds unaccepted (it accepts none while it waits for nodes)."""
    out = subprocess.run(lan.command("head", "ss", "-Hltn", f"sport = :{port}"), capture_output=True, text=True)
    return int(out.stdout.split()[1])


@pytest.mark.extended  # network namespaces: CI's second run
@pytest.mark.skipif(available() is not None, reason=f"no network namespaces here: {available()}")
def test_forged_announcements_on_a_lan_get_no_connection_from_a_waiting_head(tmp_path, default_model):
    lan, procs = Lan(), []
    try:
        head, evil = lan.add("head"), lan.add("evil")
        # An address on none of the head's networks that it could still reach (routed through evil):
        # were the announcement dialled, its listener would count it.
        subprocess.run(lan.command("evil", "ip", "addr", "add", "10.236.0.1/32", "dev", "lo"), check=True)
        subprocess.run(lan.command("head", "ip", "route", "add", "10.236.0.0/24", "via", evil), check=True)
        far, other, stranger = "10.236.0.1:47001", f"{evil}:47002", f"{evil}:47003"
        spec = {"listen": [far, other, stranger], "announce": [
            {"instance": "far", "addresses": ["10.236.0.1"], "port": 47001, "txt": {"cid": OURS, "name": "far"}},
            {"instance": "other", "addresses": [evil], "port": 47002, "txt": {"cid": OTHER, "name": "other"}},
            {"instance": "stranger\u202e", "addresses": [evil], "port": 47003,
             "txt": {"cid": OURS, "name": FORGED_NAME, "mem": "abc", "chip": "c\x1b[2J", "ver": "1\n2"}},
            {"instance": "http", "addresses": [head], "port": HTTP_PORT, "txt": {"cid": OURS, "name": "http"}},
            {"instance": "http-lo", "addresses": ["127.0.0.1"], "port": HTTP_PORT, "txt": {"cid": OURS}}]}
        forger = subprocess.Popen(lan.command("evil", sys.executable, str(TESTS / "forger.py"), json.dumps(spec)),
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        procs.append(forger)
        assert forger.stdout.readline().strip() == "ready"
        accepted: list = []
        threading.Thread(target=lambda: accepted.extend(iter(forger.stdout.readline, "")), daemon=True).start()
        for where in (far, other):  # the head's namespace reaches each listener: the test's own, counted
            host, port = where.split(":")
            subprocess.run(lan.command("head", sys.executable, "-c", f"import socket; socket.create_connection("
                                       f"('{host}', {port}), 5).close()"), check=True)
        log_path = tmp_path / "head.log"
        env = dict(os.environ, MLXPIPE_SECRET=SECRET)
        with open(log_path, "w") as log:
            procs.append(subprocess.Popen(lan.command(
                "head", sys.executable, "-m", "mlxpipe.server.cli", "serve", "--discover", "--wait-nodes", "1",
                "--model", str(default_model), "--host", "0.0.0.0", "--port", str(HTTP_PORT)),
                stdout=subprocess.DEVNULL, stderr=log, env=env))
        deadline = time.monotonic() + 120
        while "looking for 1 of this cluster's nodes" not in log_path.read_text():
            assert time.monotonic() < deadline and procs[-1].poll() is None, log_path.read_text()
            time.sleep(0.2)
        looking = time.monotonic()
        subprocess.run(lan.command("head", sys.executable, "-c", "import socket; socket.create_connection("
                                   f"('127.0.0.1', {HTTP_PORT}), 5).close()"), check=True)
        while "still looking" not in log_path.read_text():
            assert time.monotonic() - looking < 30, log_path.read_text()
            time.sleep(0.2)
        time.sleep(max(0.0, looking + 60 - time.monotonic()))  # the 60 s: 60 watch intervals of the head's
        counts = {w: _accepts(accepted, w) for w in (far, other, stranger)}
        assert counts[far] == 1 and counts[other] == 1, counts  # the test's own: never the head's
        # An on-link announcement of this cluster may be asked to prove the secret: one Hello, again
        # after 30 s when it did not answer (it never learns the secret either way).
        assert 1 <= counts[stranger] <= 3, counts
        assert _queued(lan, HTTP_PORT) == 1  # the test's own: never the head's
        text = log_path.read_text()
        assert "\x1b" not in text and not [l for l in text.splitlines() if l.startswith("FORGED")], text
        assert "Task exception was never retrieved" not in text and "Traceback" not in text, text
        for field in ("name", "mem", "chip", "ver"):
            assert text.count(f"announcement stranger\\u202e: field {field} skipped") == 1, text
        assert "'evil\\x1b[31mRED\\nFORGED LOG LINE: node ok'" in text, text
        hints = [l for l in text.splitlines() if l.startswith("still looking")]
        assert len(hints) == len(set(hints)) <= 3, hints  # said again only when something changed
        assert "10.236.0.1:47001 is not on a network this machine is on" in hints[-1], hints
        assert "another cluster" in hints[-1] and "the network:" in hints[-1], hints
        assert f"{head}:{HTTP_PORT} is this head's own listening socket" in text, text
        assert f"127.0.0.1:{HTTP_PORT} is this head's own listening socket" in text, text
        out = subprocess.run(lan.command("head", sys.executable, "-m", "mlxpipe.server.cli", "nodes", "--discover"),
                             capture_output=True, text=True, timeout=60, env=env)
        assert "\x1b" not in out.stdout + out.stderr and "stranger\\u202e" in out.stdout, out.stdout
        assert out.stderr.count("field name skipped: not printable text: 'evil\\x1b[31mRED\\n") == 1, out.stderr
        rows = {line.split()[0]: line for line in out.stdout.splitlines()[1:]}
        assert "no: another cluster" in rows["other"] and "is not on a network" in rows["far"], out.stdout
        assert _accepts(accepted, far) == 1 and _accepts(accepted, other) == 1, accepted
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
        lan.close()
