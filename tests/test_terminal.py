"""The server and the commands as a person meets them in a terminal or a log: the banner,
one line per request, progress in a log, finding the running head, typos, --version."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from importlib.metadata import version

import httpx
import pytest

from server_proc import ServerProcess

LINE = re.compile(r"^(POST|GET) (\S+) (\d{3})(?: prompt=(\d+) cached=(\d+) completion=(\d+)(?: ttft=([\d.]+)s"
                  r"(?: ([\d.]+) tok/s)?)?)? ([\d.]+)s(?:: (.+))?$")


def mlxpipe(*args, env=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "mlxpipe.server.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    return tmp_path_factory.mktemp("home")


@pytest.fixture(scope="module")
def server(default_model, home):
    """One stage, in a home of its own (its state file is the only one there), stderr kept:
    a pipe, not a terminal, as under a service manager."""
    env = {**os.environ, "MLXPIPE_HOME": str(home)}
    env.pop("MLXPIPE_URL", None)
    srv = ServerProcess("--model", str(default_model), "--stages", "1", "--max-tokens", "16", "--temp", "0",
                        env=env, capture_log=True)
    srv.banner += [srv.proc.stdout.readline() for _ in range(3)]
    yield srv
    srv.stop()


def log_lines(srv, path: str, since: int, n: int = 1, timeout: float = 30) -> list:
    """The request lines for ``path`` logged after the first ``since`` lines (at least ``n``)."""
    deadline = time.monotonic() + timeout
    while True:
        found = [m for m in map(LINE.match, srv.log[since:]) if m and m.group(2) == path]
        if len(found) >= n or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def test_banner_names_the_page_the_api_and_the_model(server, default_model):
    first, page, api, model = server.banner
    assert re.fullmatch(r"mlxpipe serving \S+ on http://127\.0\.0\.1:\d+/v1\n", first)
    assert page.split() == ["chat", "page:", f"{server.root}/"]
    assert api.split()[:2] == ["API:", server.base_url]
    assert model.split()[:2] == ["model:", default_model.name]
    assert httpx.get(page.split()[-1]).status_code == 200  # the page is where it says


def test_stage_loading_says_how_far_in_a_log(server):
    assert any(re.search(r"loading \S+ on 1 stage: 1 of 1 stages loaded", line) for line in server.log), server.log


def test_one_line_per_request_with_tokens_and_timings(server):
    since = len(server.log)
    chat = httpx.post(f"{server.base_url}/chat/completions", timeout=120, json={
        "model": "default", "messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 8}).json()
    with httpx.stream("POST", f"{server.base_url}/chat/completions", timeout=120, json={
            "model": "default", "messages": [{"role": "user", "content": "Name a fruit."}], "max_tokens": 6,
            "stream": True}) as resp:
        assert resp.status_code == 200 and list(resp.iter_lines())
    ollama = httpx.post(f"{server.root}/api/chat", timeout=120, json={
        "model": "default", "messages": [{"role": "user", "content": "Hi"}], "stream": False,
        "options": {"num_predict": 5}}).json()
    anthropic = httpx.post(f"{server.base_url}/messages", timeout=120, json={
        "model": "default", "max_tokens": 4, "messages": [{"role": "user", "content": "Hi"}]}).json()
    httpx.get(f"{server.root}/health")  # polls get no line

    c, s = log_lines(server, "/v1/chat/completions", since, 2)
    usage = chat["usage"]
    assert c.group(3) == "200" and c.group(10) is None
    assert (int(c.group(4)), int(c.group(6))) == (usage["prompt_tokens"], usage["completion_tokens"])
    assert int(c.group(5)) == usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
    assert 0 < float(c.group(7)) <= float(c.group(9))  # the first token came before the end
    assert int(s.group(6)) == 6 and s.group(8) is not None and float(s.group(8)) > 0  # streamed: tok/s too
    (o,) = log_lines(server, "/api/chat", since)
    assert (int(o.group(4)), int(o.group(6))) == (ollama["prompt_eval_count"], ollama["eval_count"])
    (a,) = log_lines(server, "/v1/messages", since)
    assert int(a.group(6)) == anthropic["usage"]["output_tokens"]
    assert not log_lines(server, "/health", since, timeout=0)


def test_refusals_get_a_line_and_no_misleading_tokenizer_warning(server):
    since = len(server.log)
    # Longer than the model's context (8192): the server says so itself; transformers must not add
    # that the prompt "will result in indexing errors".
    resp = httpx.post(f"{server.base_url}/chat/completions", timeout=120, json={
        "model": "default", "messages": [{"role": "user", "content": "hello " * 9000}]})
    assert resp.status_code == 400 and "maximum context length" in resp.json()["error"]["message"]
    (line,) = log_lines(server, "/v1/chat/completions", since)
    assert line.group(3) == "400" and line.group(4) is None  # no token counts for a refusal
    assert "maximum context length" in line.group(10), line.group(0)  # and the reason it was given
    assert not any("Token indices sequence length" in x for x in server.log)


def _requests_counted(srv, status: str) -> float:
    """``/metrics``' count of chat completions answered with ``status``."""
    text = httpx.get(f"{srv.root}/metrics", timeout=30).text
    key = f'mlxpipe_http_requests_total{{route="/v1/chat/completions",status="{status}"}} '
    return sum(float(x.split()[-1]) for x in text.splitlines() if x.startswith(key))


def test_a_client_that_goes_away_is_logged_as_499_with_the_tokens_it_was_sent(server):
    since, counted = len(server.log), {s: _requests_counted(server, s) for s in ("200", "499")}
    body = {"model": "default", "messages": [{"role": "user", "content": "Tell me a long story."}],
            "max_tokens": 400, "stream": True}
    with httpx.stream("POST", f"{server.base_url}/chat/completions", timeout=120, json=body) as resp:
        events = resp.iter_lines()
        got = [line for line, _ in zip((x for x in events if x.startswith("data: {")), range(3))]
    assert len(got) == 3  # ... and it hangs up, mid-reply
    (line,) = log_lines(server, "/v1/chat/completions", since)
    assert line.group(3) == "499", line.group(0)  # not 200: the reply was cut by the client
    sent = int(line.group(6))
    assert 2 <= sent < 400 and line.group(10) == f"the client went away after {sent} tokens were sent"
    # /metrics counts it as the log does: a 499, not the 200 the stream had begun with.
    assert _requests_counted(server, "499") == counted["499"] + 1
    assert _requests_counted(server, "200") == counted["200"]
    since = len(server.log)
    with pytest.raises(httpx.ReadTimeout):  # waiting for a whole reply, then gone
        httpx.post(f"{server.base_url}/chat/completions", timeout=1.5, json=body | {"stream": False})
    (line,) = log_lines(server, "/v1/chat/completions", since)
    assert line.group(3) == "499" and "the client went away before the reply was complete" in line.group(10)
    assert _requests_counted(server, "499") == counted["499"] + 2


@pytest.mark.parametrize("part, says", [
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}, "images are not supported: this model "
                                                                               "takes text only"),
    ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}, "audio parts are not supported"),
    ({"type": "video_frame"}, "unknown content part type 'video_frame'"),
])
def test_parts_a_text_model_cannot_take_are_named(server, part, says):
    resp = httpx.post(f"{server.base_url}/chat/completions", timeout=30, json={
        "model": "default", "messages": [{"role": "user", "content": [{"type": "text", "text": "What is this?"},
                                                                      part]}]})
    assert resp.status_code == 400
    message = resp.json()["error"]["message"]
    assert message.startswith(f"messages.0.content.1: {says}"), message
    assert "valid string" not in message


def test_status_finds_the_head_through_its_state_file(server, home):
    state = json.loads((home / "serve.json").read_text())
    assert state == {"url": server.root, "pid": server.proc.pid}
    env = {**os.environ, "MLXPIPE_HOME": str(home)}
    env.pop("MLXPIPE_URL", None)
    out = mlxpipe("status", env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(server.banner[3].split()[1] + ": ok"), out.stdout
    out = mlxpipe("nodes", env=env)
    assert out.returncode == 0 and "no node has joined" in out.stdout, out.stderr


def test_status_finds_the_head_through_mlxpipe_url_and_url_wins(server, tmp_path):
    env = {**os.environ, "MLXPIPE_HOME": str(tmp_path), "MLXPIPE_URL": server.base_url}
    out = mlxpipe("status", env=env)
    assert out.returncode == 0 and ": ok" in out.stdout, out.stderr
    env["MLXPIPE_URL"] = "http://127.0.0.1:9"
    out = mlxpipe("status", "--url", server.root, env=env)
    assert out.returncode == 0 and ": ok" in out.stdout, out.stderr
    out = mlxpipe("status", env=env)
    assert out.returncode == 2 and "cannot reach the head at http://127.0.0.1:9" in out.stderr


def test_a_dead_servers_state_file_is_ignored(tmp_path, monkeypatch):
    from mlxpipe.server.cli.running import DEFAULT_URL, head_url

    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    monkeypatch.setenv("MLXPIPE_HOME", str(tmp_path))
    monkeypatch.delenv("MLXPIPE_URL", raising=False)
    (tmp_path / "serve.json").write_text(json.dumps({"url": "http://127.0.0.1:1234", "pid": gone.pid}))
    assert head_url(None) == DEFAULT_URL
    (tmp_path / "serve.json").write_text(json.dumps({"url": "http://127.0.0.1:1234", "pid": os.getpid()}))
    assert head_url(None) == "http://127.0.0.1:1234"


def test_the_state_file_goes_when_the_server_stops(server, home):
    server.stop()
    assert server.proc.returncode == 143
    assert not (home / "serve.json").exists()


def test_version():
    out = mlxpipe("--version")
    assert out.returncode == 0 and out.stdout == f"mlxpipe {version('mlxpipe')}\n", out


@pytest.mark.parametrize("args, usage, hint", [
    (["serve", "--prot", "8080"], "usage: mlxpipe serve", "did you mean --port?"),
    (["status", "--jsn"], "usage: mlxpipe status", "did you mean --json?"),
    (["serv"], "usage: mlxpipe ", "did you mean serve?"),
])
def test_a_typo_gets_the_commands_usage_and_the_closest_name(args, usage, hint):
    out = mlxpipe(*args)
    assert out.returncode == 2
    assert out.stderr.startswith(usage), out.stderr
    assert f"({hint})" in out.stderr.splitlines()[-1], out.stderr
