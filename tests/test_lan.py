"""A cluster that finds itself, for real: nodes in network namespaces on a bridge (multicast
DNS crosses it), one link throttled with `tc tbf`, one delayed by the fault proxy, a node
of another cluster beside them. `serve --discover` with only the secret finds its three,
serves mlx-lm's tokens, reports every link (the slow ones named), never gives the
stranger a layer, and drops a killed node within the stated time.

Needs root (network namespaces); skipped, saying why, elsewhere. One set-up for the
module: four node processes, a proxy and a head."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from conftest import SECRET, stage_stub
from netns import Lan, available
from test_equality import _prompt_ids

from mlxpipe.proto import pipeline_pb2 as pb
from mlxpipe.server.cluster.discovery import CHECK_EVERY_S, DROP_AFTER_S

pytestmark = [pytest.mark.extended,  # network namespaces: CI's second run (`pytest -m extended`)
              pytest.mark.skipif(available() is not None, reason=f"no network namespaces here: {available()}")]

RATE = 5_000_000        # bytes/s of the throttled node's link (tbf 40mbit)
DELAY = 0.02            # seconds the proxy holds bytes each way in front of the third node
STRANGER = "another-cluster-secret-0123456789"
NEW = 16
TESTS = Path(__file__).parent


def _node(lan: Lan, host: str, home: Path, secret: str, *extra: str) -> subprocess.Popen:
    env = dict(os.environ, MLXPIPE_HOME=str(home / host), MLXPIPE_SECRET=secret)
    proc = subprocess.Popen(lan.command(host, sys.executable, "-m", "mlxpipe.shards.worker.node", "--announce",
                                        "--name", host, "--log-level", "WARNING", *extra),
                            stdout=subprocess.PIPE, text=True, env=env)
    assert "listening on" in proc.stdout.readline()
    return proc


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, dsv3_model):
    home = tmp_path_factory.mktemp("lan")
    lan, procs = Lan(), {}
    try:
        for host in ("n1", "n2", "n3", "x", "head"):
            lan.add(host)
        here = lan.reach_from_here()
        lan.throttle("n2", "40mbit")
        proxy = subprocess.Popen(lan.command("n3", sys.executable, str(TESTS / "faultproxy.py"), lan.hosts["n3"],
                                             "127.0.0.1", "50051", str(DELAY)), stdout=subprocess.PIPE, text=True)
        procs["proxy"] = proxy
        behind = f"{lan.hosts['n3']}:{proxy.stdout.readline().strip()}"
        procs["n1"] = _node(lan, "n1", home, SECRET)
        procs["n2"] = _node(lan, "n2", home, SECRET)
        procs["n3"] = _node(lan, "n3", home, SECRET, "--advertise", behind)
        procs["x"] = _node(lan, "x", home, STRANGER)
        env = dict(os.environ, MLXPIPE_SECRET=SECRET)
        log = open(home / "head.log", "w")
        head = subprocess.Popen(lan.command("head", sys.executable, "-m", "mlxpipe.server.cli", "serve", "--discover",
                                            "--wait-nodes", "3", "--split", "even", "--model", str(dsv3_model),
                                            "--host", "0.0.0.0", "--port", "0", "--temp", "0"),
                                stdout=subprocess.PIPE, stderr=log, text=True, env=env)
        procs["head"] = head
        line = head.stdout.readline()
        assert "serving" in line, (home / "head.log").read_text()[-4000:]
        url = line.split(" on ")[1].strip().replace("0.0.0.0", lan.hosts["head"])
        banner: list = []  # the lines after the first (stages, the plan's prediction), as they come
        threading.Thread(target=lambda: banner.extend(iter(head.stdout.readline, "")), daemon=True).start()
        deadline = time.monotonic() + 30
        while not any("predicted" in line for line in banner) and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)
        yield dict(lan=lan, url=url, root=url.removesuffix("/v1"), procs=procs, here=here, behind=behind,
                   banner="".join(list(banner)), home=home)
    finally:
        for name, proc in procs.items():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM if name == "head" else signal.SIGKILL)
        for proc in procs.values():
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
        lan.close()


def _complete(c, prompt) -> str:
    r = httpx.post(f"{c['url']}/completions", timeout=120,
                   json={"model": "model", "prompt": prompt, "max_tokens": NEW, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _want(path, reference, prompt) -> str:
    from mlx_lm.utils import load_tokenizer

    tok = load_tokenizer(path)
    # (the text the tokens add to the prompt's: a first token's leading space included)
    generated = [t for t in reference(path, prompt, NEW) if t not in tok.eos_token_ids]
    return tok.decode(prompt + generated)[len(tok.decode(prompt)):]


def test_nodes_discover_lists_this_clusters_nodes_and_not_the_strangers(cluster):
    lan = cluster["lan"]
    out = subprocess.run(lan.command("head", sys.executable, "-m", "mlxpipe.server.cli", "nodes", "--discover"),
                         capture_output=True, text=True, timeout=60, env=dict(os.environ, MLXPIPE_SECRET=SECRET))
    rows = {line.split()[0]: line for line in out.stdout.splitlines()[1:]}
    for host in ("n1", "n2", "n3"):
        assert " this " in rows[host] and " yes " in rows[host], out.stdout
    assert rows["n3"].split()[1] == cluster["behind"]  # as it advertised itself: behind the proxy
    assert " another " in rows["x"] and "no: another cluster" in rows["x"], out.stdout


def test_the_discovered_cluster_serves_mlx_lm_tokens_and_the_stranger_holds_nothing(cluster, dsv3_model, reference):
    h = httpx.get(f"{cluster['root']}/health", timeout=30).json()
    addresses = [s["address"] for s in h["stages"]]
    lan = cluster["lan"]
    assert addresses == [f"{lan.hosts['n1']}:50051", f"{lan.hosts['n2']}:50051", cluster["behind"]], addresses
    prompts = _prompt_ids(dsv3_model)[:2]
    long = (prompts[0] * 20)[:600]  # prefill chunks big enough to show a hop's throughput
    for p in [*prompts, long]:
        assert _complete(cluster, p) == _want(dsv3_model, reference, p)
    stranger = stage_stub(f"{lan.hosts['x']}:50051", secret=STRANGER).Health(pb.HealthRequest(), timeout=10)
    assert stranger.state == "empty" and stranger.num_layers == 0, stranger  # never loaded a layer
    nodes = httpx.get(f"{cluster['root']}/nodes", timeout=10).json()
    (x,) = [n for n in nodes["discovered"] if n["address"] == f"{lan.hosts['x']}:50051"]
    assert not x["usable"] and x["cluster"] == "another", x  # listed, never usable
    assert f"{lan.hosts['x']}:50051" not in nodes["discovery"]["usable"]


def test_status_lists_every_link_as_tc_and_the_proxy_make_it_and_names_the_slow_ones(cluster):
    lan, n2 = cluster["lan"], cluster["lan"].hosts["n2"]
    h = httpx.get(f"{cluster['root']}/health", timeout=30).json()
    links = {l["name"]: l for l in h["links"]}
    assert set(links) == {"head -> stage 0", "head -> stage 1", "head -> stage 2", "stage 0 -> stage 1",
                          "stage 1 -> stage 2"}, links
    for name in ("head -> stage 1", "stage 0 -> stage 1", "stage 1 -> stage 2"):  # through n2's throttled link
        assert RATE / 2 < links[name]["bytes_per_s"] < RATE * 2, (name, links[name])
    for name in ("head -> stage 2", "stage 1 -> stage 2"):  # through the proxy
        assert DELAY / 2 < links[name]["latency_s"] < DELAY * 2, (name, links[name])
    fast = links["head -> stage 0"]
    assert fast["bytes_per_s"] > 10 * RATE and fast["latency_s"] < DELAY / 4, fast
    warned = " ".join(h["link_warnings"])
    assert f"link head -> stage 1 (head -> {n2}:50051) is far slower than the others" in warned, warned
    assert "link head -> stage 0 " not in warned, warned
    # The banner's prediction prices every hop, the throttled one at what it measured.
    priced = [l for l in cluster["banner"].splitlines() if f"-> {n2}:50051:" in l]
    assert len(priced) == 1, cluster["banner"] + (cluster["home"] / "head.log").read_text()[-3000:]
    priced = priced[0]
    assert "MB/s" in priced and RATE / 2e6 < float(priced.split(" MB/s")[0].rsplit(" ", 1)[1]) < 2 * RATE / 1e6, priced
    assert "predicted with the links priced" in cluster["banner"], cluster["banner"]
    out = subprocess.run(lan.command("head", sys.executable, "-m", "mlxpipe.server.cli", "status", "--url",
                                     cluster["url"]), capture_output=True, text=True, timeout=60)
    assert "stage 0 -> stage 1" in out.stdout and "far slower" in out.stdout, out.stdout
    metrics = httpx.get(f"{cluster['root']}/metrics", timeout=30).text
    assert 'mlxpipe_link_bytes_per_second{link="head -> stage 1"' in metrics


def test_a_killed_node_leaves_the_list_in_time_and_the_cluster_replans_without_it(cluster, dsv3_model, reference):
    lan, n1 = cluster["lan"], f"{cluster['lan'].hosts['n1']}:50051"
    cluster["procs"]["n1"].kill()
    killed = time.monotonic()
    while True:
        listed = {n["address"] for n in httpx.get(f"{cluster['root']}/nodes", timeout=10).json()["discovered"]}
        if n1 not in listed:
            break
        assert time.monotonic() - killed < DROP_AFTER_S + 2 * CHECK_EVERY_S + 2, "the killed node is still listed"
        time.sleep(0.2)
    out = subprocess.run(lan.command("head", sys.executable, "-m", "mlxpipe.server.cli", "nodes", "--url",
                                     cluster["url"]), capture_output=True, text=True, timeout=60)
    assert lan.hosts["n2"] in out.stdout and lan.hosts["n1"] + ":" not in out.stdout, out.stdout
    prompt = _prompt_ids(dsv3_model)[1]
    assert _complete(cluster, prompt) == _want(dsv3_model, reference, prompt)  # replayed over the others
    h = httpx.get(f"{cluster['root']}/health", timeout=30).json()
    assert [s["address"] for s in h["stages"]] == [f"{lan.hosts['n2']}:50051", cluster["behind"]], h["stages"]
