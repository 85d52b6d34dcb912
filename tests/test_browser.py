"""The page at `/`, driven in headless Chromium against a real server with two stages;
and a page on another origin calling the API with fetch, as a browser app would.

The page's own files (its modules, marked, DOMPurify, highlight.js) are always the
real ones, served by the real server. Only where a reply must hold a given text
(markdown to render, a hostile payload to neutralise), which the default model cannot
be made to write, does Playwright answer `/v1/chat/completions` itself: with a canned
stream built from a stream the real server has just sent (`captured_stream`), its
events copied with other deltas. Streaming, the reload and the Stop button use the
real server.

Needs Debian's Chromium (`apt-get install -y --no-install-recommends chromium`; on macOS
MLXPIPE_CHROMIUM pointing at Chromium or Chrome, else it skips) and the Python `playwright`
package (`pip install playwright`); `playwright install` is not needed, the system
browser is used.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import threading
import sys
import time
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from server_proc import ServerProcess

CHROMIUM = os.environ.get("MLXPIPE_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
ARTIFACTS = Path(__file__).parent / "artifacts"


@pytest.fixture(scope="module")
def server(default_server):
    return default_server


@pytest.fixture(scope="module")
def page():
    if not (os.path.exists(CHROMIUM) or shutil.which(CHROMIUM)):
        if sys.platform == "darwin":  # no system Chromium to expect there
            pytest.skip(f"no Chromium at {CHROMIUM}: on macOS, set MLXPIPE_CHROMIUM to a Chromium or Chrome "
                        "binary (e.g. /Applications/Google Chrome.app/Contents/MacOS/Google Chrome)")
        pytest.fail(f"Chromium not found at {CHROMIUM}: install it with `sudo apt-get install -y chromium` "
                    "(Debian/Ubuntu), or point MLXPIPE_CHROMIUM at a Chromium binary", pytrace=False)
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("the `playwright` package is missing: pip install 'playwright>=1.40' "
                    "(no `playwright install` needed, the system Chromium is used)", pytrace=False)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        page = browser.new_page(viewport={"width": 1280, "height": 800})
        page.set_default_timeout(60_000)
        yield page
        browser.close()


def stage_figures(page):
    """(busy text, tokens/s text) of every stage card, as the page shows them now."""
    return page.eval_on_selector_all(
        ".stage", "els => els.map(e => [e.querySelector('.busy').textContent, e.querySelector('.tps').textContent])")


def test_page_chats_and_shows_the_cluster(page, server):   # page first: no browser, no server start
    health = httpx.get(f"{server.root}/health", timeout=10).json()
    page.goto(f"{server.root}/")

    # The cluster view: two stages, with /health's layer ranges and addresses.
    page.wait_for_function("document.querySelectorAll('.stage .layers').length === 2 && "
                           "[...document.querySelectorAll('.stage .layers')].every(e => e.textContent)")
    assert page.locator("#cluster-status").text_content() == "ready"
    page.wait_for_function("document.querySelector('#speculation').textContent !== '–'")
    assert page.locator("#rate-chart").count() == 1
    shown = page.locator(".stage .layers").all_text_contents()
    assert shown == [f"[{a}, {b})" for a, b in (s["layers"] for s in health["stages"])]
    assert page.locator(".stage .address").all_text_contents() == [s["address"] for s in health["stages"]]
    assert page.locator("#model").text_content() == f"{health['model']} · {health['context_length']:,}-token context"

    # Wait for an idle reading (busy fractions are over the last 10 s), then note it.
    page.wait_for_function("[...document.querySelectorAll('.stage .tps')].every(e => e.textContent === '0.0')",
                           timeout=30_000)
    before = stage_figures(page)

    # Shift+Enter is a new line, not a send.
    page.fill("#prompt", "draft")
    page.press("#prompt", "Shift+Enter")
    assert page.input_value("#prompt") == "draft\n" and page.locator(".msg.user").count() == 0

    # Chat: a small budget, since the CPU model makes only a few tokens a second.
    page.fill("#max_tokens", "24")
    page.fill("#temperature", "0")
    page.fill("#prompt", "Write a short poem about the sea.")
    with page.expect_request("**/v1/chat/completions") as sent:
        page.press("#prompt", "Enter")
    body = json.loads(sent.value.post_data)
    assert body["stream"] is True and body["model"] == "default" and body["stream_options"] == {"include_usage": True}
    assert body["messages"] == [{"role": "user", "content": "Write a short poem about the sea."}]
    assert body["max_tokens"] == 24 and body["temperature"] == 0 and body["top_p"] == 1
    assert "top_k" not in body and "seed" not in body and "stop" not in body   # unset: not sent
    assert page.locator(".msg.user").text_content() == "Write a short poem about the sea."
    reply = page.locator(".msg.assistant .answer")

    # While the Stop button is live the reply streams (its text grows between readings)
    # and the cluster view moves (busy % and tokens/s are read every second).
    lengths, readings = [], []
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and page.is_enabled("#stop"):
        text = reply.text_content() if reply.count() else ""
        if text and (not lengths or len(text) > lengths[-1]):
            lengths.append(len(text))
        readings.append(stage_figures(page))
        time.sleep(0.2)
    assert len(lengths) >= 2 and lengths[-1] > lengths[0], \
        f"the reply did not stream: {lengths}; messages: {page.inner_html('#messages')}"
    assert any(r != before for r in readings), f"the cluster view never changed from {before}"
    busy = [int(b.rstrip("%")) for r in readings for b, _ in r if b.endswith("%")]
    assert max(busy, default=0) > 0, f"no stage ever showed a busy fraction above 0: {readings}"

    page.wait_for_selector("#send:enabled", timeout=120_000)
    final = reply.text_content()
    assert final.strip(), "the final reply is empty"
    assert page.locator(".msg.error").count() == 0
    # The figures from the closing usage: 24 tokens (the budget, or fewer at an end of text).
    stats = page.locator(".msg.assistant .stats").text_content()
    assert re.search(r"^\d+ tokens · [\d.]+ tok/s · first token [\d.]+ s · \d+ of \d+ prompt tokens cached$", stats), stats
    # Every stage keeps the chat's prompt in its prefix cache, and the page shows the bytes.
    page.wait_for_function("[...document.querySelectorAll('.stage .prefix')].every(e => parseFloat(e.textContent) > 0)",
                           timeout=10_000)
    # ... and on its disk, written through: the bytes there, of what the disk tier may hold.
    page.wait_for_function("[...document.querySelectorAll('.stage .disk')].every(e => "
                           "/ of \\d+ MB$/.test(e.textContent) && parseFloat(e.textContent) > 0)", timeout=10_000)

    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "browser.png"), full_page=True)


def captured_stream(server) -> list:
    """The events of a real streamed reply (with its usage chunk), as the server sends them."""
    body = {"model": "default", "stream": True, "stream_options": {"include_usage": True}, "max_tokens": 3,
            "temperature": 0, "messages": [{"role": "user", "content": "Say hi"}]}
    with httpx.stream("POST", f"{server.base_url}/chat/completions", json=body, timeout=60) as r:
        lines = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]", lines
    events = [json.loads(line) for line in lines[:-1]]
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert events[-1]["choices"] == [] and "cached_tokens" in events[-1]["usage"]["prompt_tokens_details"]
    return events


def canned_stream(template: list, deltas: list, finish: str, usage: dict) -> str:
    """A server-sent event body shaped as ``template`` (``captured_stream``'s events): its
    opening, one chunk per delta (the last with ``finish``), its usage chunk, ``[DONE]``."""
    opening, chunk, closing = template[0], template[1], template[-1]
    events = [opening]
    for i, delta in enumerate(deltas):
        choice = dict(chunk["choices"][0], delta=delta, finish_reason=finish if i == len(deltas) - 1 else None)
        events.append(dict(chunk, choices=[choice]))
    events.append(dict(closing, usage=dict(closing["usage"], **usage)))
    return "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"


def pieces(text: str, size: int = 7) -> list:
    return [{"content": text[i:i + size]} for i in range(0, len(text), size)]


MARKDOWN_REPLY = """Here is a function that reads a file:

```python
def read_lines(path):
    with open(path) as f:
        return [line.rstrip() for line in f]
```

It works in three steps:

1. open the file
2. read each line
3. strip the newline

Things to watch:

- **large files**: read them lazily
- `encoding`: pass it when the file is not UTF-8

| mode | reads | writes |
| --- | --- | --- |
| `r` | yes | no |
| `w` | no | yes |
"""

HOSTILE_REPLY = """Careful with this one.

<img src=x onerror="window.__pwned = 'img'">
<script>window.__pwned = 'script'</script>
<svg><g onload="window.__pwned = 'svg'"></g></svg>
<iframe srcdoc="<script>parent.__pwned = 'iframe'</script>"></iframe>

A [link](javascript:void(window.__pwned='link')) and <a href="javascript:void(window.__pwned='anchor')">an anchor</a>.

![tracker](http://127.0.0.1:9/track.png)
"""


def test_replies_render_as_markdown_and_hostile_html_is_inert(page, server):
    template = captured_stream(server)
    replies = [
        canned_stream(template, [{"reasoning_content": "The user wants a file reader. "},
                                 {"reasoning_content": "Show code, steps and a table."}, *pieces(MARKDOWN_REPLY)],
                      "length", {"prompt_tokens": 40, "completion_tokens": 96, "total_tokens": 136,
                                 "prompt_tokens_details": {"cached_tokens": 32}}),
        canned_stream(template, [*pieces(HOSTILE_REPLY),
                                 {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                                  "function": {"name": "get_weather", "arguments": ""}}]},
                                 {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]},
                                 {"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]}],
                      "tool_calls", {}),
    ]
    sent, fetched = [], []
    watch = lambda request: fetched.append(request.url)  # noqa: E731
    page.on("request", watch)

    def answer(route):
        sent.append(json.loads(route.request.post_data))
        route.fulfill(status=200, body=replies[len(sent) - 1],
                      headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})

    page.goto(f"{server.root}/")
    page.click("#new-chat")
    page.route("**/v1/chat/completions", answer)
    try:
        page.fill("#prompt", "How do I read a file in Python?")
        page.press("#prompt", "Enter")
        page.wait_for_selector(".msg.assistant .stats:has-text('tokens')")
        reply = page.locator(".msg.assistant").last
        # The fenced block is highlighted code with a Copy button; the lists and the table are real.
        code = reply.locator(".answer pre > code.hljs.language-python")
        assert code.count() == 1 and code.locator(".hljs-keyword").count() >= 3
        assert code.text_content().startswith("def read_lines(path):")
        assert reply.locator(".answer ol > li").all_text_contents() == ["open the file", "read each line",
                                                                        "strip the newline"]
        assert reply.locator(".answer ul > li").count() == 2 and reply.locator(".answer ul strong").count() == 1
        assert reply.locator(".answer table th").all_text_contents() == ["mode", "reads", "writes"]
        assert reply.locator(".answer table tbody tr").count() == 2
        ARTIFACTS.mkdir(exist_ok=True)
        page.set_viewport_size({"width": 1280, "height": 960})   # the whole reply in view
        page.evaluate("document.querySelector('#messages').scrollTop = 0")
        page.screenshot(path=str(ARTIFACTS / "page-chat.png"))
        page.set_viewport_size({"width": 1280, "height": 800})
        page.context.grant_permissions(["clipboard-read", "clipboard-write"], origin=server.root)
        reply.locator(".code .copy").click()
        assert page.evaluate("navigator.clipboard.readText()") == code.text_content()
        # The reasoning sits collapsed above the answer; the cut at max_tokens and the usage are shown.
        reasoning = reply.locator("details.reasoning")
        assert reasoning.is_visible() and reasoning.get_attribute("open") is None
        assert reasoning.locator(".reasoning-text").text_content() == \
            "The user wants a file reader. Show code, steps and a table."
        assert "max_tokens" in reply.locator(".note.length").text_content()
        stats = reply.locator(".stats").text_content()
        assert stats.startswith("96 tokens · ") and stats.endswith("32 of 40 prompt tokens cached"), stats

        # The second request carries the conversation: the answer without its reasoning.
        page.fill("#prompt", "And something dangerous?")
        page.press("#prompt", "Enter")
        page.wait_for_selector(".msg.assistant >> nth=1 >> .tool-call")
        page.wait_for_selector("#send:enabled")
        assert [m["role"] for m in sent[1]["messages"]] == ["user", "assistant", "user"]
        assert sent[1]["messages"][1] == {"role": "assistant", "content": MARKDOWN_REPLY}
        hostile = page.locator(".msg.assistant").nth(1)
        assert "Careful with this one." in hostile.locator(".answer").text_content()
        for link in hostile.locator(".answer a").all():
            if link.text_content() in ("link", "an anchor"):
                link.click()
        page.wait_for_timeout(500)
        assert page.evaluate("window.__pwned") is None, f"a payload in a reply ran: {page.evaluate('window.__pwned')}"
        hrefs = [a.get_attribute("href") or "" for a in hostile.locator(".answer a").all()]
        assert not any(h.lower().startswith("javascript") for h in hrefs), hrefs
        left = page.evaluate("""() => [...document.querySelectorAll('#messages *')]
            .filter(e => ['SCRIPT', 'IMG', 'IFRAME'].includes(e.tagName)
                         || [...e.attributes].some(a => a.name.startsWith('on')))
            .map(e => e.outerHTML)""")
        assert left == [], left
        assert not any("track.png" in url for url in fetched), "a markdown image was fetched"
        # The tool call, whole once its argument pieces are in.
        assert hostile.locator(".tool-name").text_content() == "tool call: get_weather"
        assert json.loads(hostile.locator(".tool-args").text_content()) == {"city": "Paris"}
    finally:
        page.unroute("**/v1/chat/completions")
        page.remove_listener("request", watch)


RENDER_PROBE = """async () => {
    const { MarkdownView } = await import("/static/render.js");
    const el = document.createElement("div");
    document.body.append(el);
    const view = new MarkdownView(el);
    const seen = [];
    let text = "";
    for (const more of ["# Notes\\n\\nA first paragraph.\\n\\n```js\\nlet x = 1;\\n",  // the code block is open
                        "x += 1;\\n```\\n\\n- one\\n- tw",                         // closed, a list starts
                        "o\\n"]) {                                                // the list grows
        view.set(text += more, true);
        seen.push([...el.children]);
    }
    const out = {
        blocks: seen.map(s => s.length),
        kept: [seen[0][0] === seen[1][0] && seen[1][0] === seen[2][0],     // the title, all along
               seen[0][2] !== seen[1][2],                                    // the open code block, redrawn
               seen[1][2] === seen[2][2],                                    // the closed one, kept
               seen[1][3] !== seen[2][3]],                                   // the growing list, redrawn
        code: el.querySelector("code").textContent,
        items: [...el.querySelectorAll("li")].map(li => li.textContent),
    };
    el.remove();
    return out;
}"""


def test_streaming_markdown_keeps_finished_blocks(page, server):
    # Blocks whose source is complete keep their elements; only the growing tail is redrawn.
    page.goto(f"{server.root}/")
    out = page.evaluate(RENDER_PROBE)
    assert out == {"blocks": [3, 4, 4], "kept": [True, True, True, True], "code": "let x = 1;\nx += 1;",
                   "items": ["one", "two"]}, out


def test_the_conversation_survives_a_reload(page, server):
    page.goto(f"{server.root}/")
    page.click("#new-chat")
    page.fill("#max_tokens", "8")
    page.fill("#temperature", "0")
    page.fill("#prompt", "Say hello.")
    page.press("#prompt", "Enter")
    page.wait_for_selector(".msg.assistant .stats:has-text('tokens')", timeout=120_000)
    page.wait_for_selector("#send:enabled")
    before = page.inner_text("#messages")
    answer = page.locator(".msg.assistant .answer").text_content()
    assert answer.strip()

    page.reload()
    page.wait_for_selector(".msg.assistant .answer .md-block")
    assert page.locator(".msg.user").all_text_contents() == ["Say hello."]
    assert page.locator(".msg.assistant .answer").text_content() == answer
    assert page.inner_text("#messages") == before       # the figures and markers too
    assert page.input_value("#max_tokens") == "8"        # and the settings

    page.click("#new-chat")
    page.reload()
    page.wait_for_selector("#messages .empty")
    assert page.locator(".msg").count() == 0


def live_sequences(server) -> list:
    health = httpx.get(f"{server.root}/health", timeout=10).json()
    return [health["live_requests"]] + [s["live_sequences"] for s in health["stages"]]


def test_the_stop_button_ends_the_request(page, server):
    page.goto(f"{server.root}/")
    page.click("#new-chat")
    page.fill("#max_tokens", "2000")
    page.fill("#temperature", "0.7")
    page.fill("#prompt", "Tell me a long story about a lighthouse keeper.")
    page.press("#prompt", "Enter")
    # Stop once the reply streams and every stage holds the sequence.
    page.wait_for_function("document.querySelector('.msg.assistant .answer').textContent.length > 20",
                           timeout=120_000)
    deadline = time.monotonic() + 30
    while min(live_sequences(server)) == 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert min(live_sequences(server)) > 0, live_sequences(server)
    page.click("#stop")
    page.wait_for_selector("#send:enabled")
    assert page.locator(".msg.assistant .note.stopped").count() == 1
    assert page.is_disabled("#stop")

    # The server saw the browser go: the request and its caches on every stage are gone.
    deadline = time.monotonic() + 30
    while any(live_sequences(server)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert live_sequences(server) == [0, 0, 0]
    text = page.locator(".msg.assistant .answer").text_content()
    assert text and len(text) < 4000   # far from 2,000 tokens: it stopped

    # The cluster view says so too, and charts what was generated.
    page.wait_for_function("document.querySelector('#live-requests').textContent === '· 0 live requests' && "
                           "[...document.querySelectorAll('.stage .seqs')].every(e => e.textContent === '0')")
    page.wait_for_function("document.querySelector('#rate-chart polyline')?.getAttribute('points').includes(' ')")
    ARTIFACTS.mkdir(exist_ok=True)
    page.locator("#cluster").screenshot(path=str(ARTIFACTS / "page-cluster.png"))


# What the OpenAI JS SDK sends besides Authorization and Content-Type.
STAINLESS = {"x-stainless-os": "Linux", "x-stainless-lang": "js", "x-stainless-package-version": "5.0.0",
             "x-stainless-runtime": "browser:chrome", "x-stainless-runtime-version": "140.0.0",
             "x-stainless-arch": "x64", "x-stainless-retry-count": "0", "x-stainless-timeout": "600"}
API_KEY = "browser-test-key"


class _Quiet(SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def origins(tmp_path_factory):
    """Two web origins serving a blank page: the first one the API allows, the second not."""
    root = tmp_path_factory.mktemp("pages")
    (root / "index.html").write_text("<!doctype html><title>an app</title>")
    servers = [ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(root)))
               for _ in range(2)]
    for srv in servers:
        threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield [f"http://127.0.0.1:{srv.server_address[1]}" for srv in servers]
    for srv in servers:
        srv.shutdown()
        srv.server_close()


@pytest.fixture(scope="module")
def cors_server(dsv3_model, origins, tmp_path_factory):
    key = tmp_path_factory.mktemp("key") / "key"
    key.write_text(API_KEY)
    srv = ServerProcess("--model", str(dsv3_model), "--stages", "2", "--split", "even", "--cors-origin", origins[0],
                        "--api-key-file", str(key), headers={"Authorization": f"Bearer {API_KEY}"})
    yield srv
    srv.stop()


FETCH = """async ([url, headers]) => {
    try {
        const r = await fetch(url, {method: "POST", headers, body: JSON.stringify(
            {model: "default", messages: [{role: "user", content: "Hello"}], max_tokens: 8, temperature: 0})});
        return {status: r.status, body: await r.json()};
    } catch (e) {
        return {error: String(e)};
    }
}"""


def test_a_page_on_an_allowed_origin_calls_the_api_with_sdk_headers(page, origins, cors_server):
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}", **STAINLESS}
    url = f"{cors_server.base_url}/chat/completions"
    page.goto(f"{origins[0]}/")
    out = page.evaluate(FETCH, [url, headers])
    assert out.get("status") == 200, out
    assert out["body"]["choices"][0]["message"]["content"] and out["body"]["usage"]["completion_tokens"] > 0

    # Another origin: the browser's preflight is refused, and the request is never sent.
    page.goto(f"{origins[1]}/")
    out = page.evaluate(FETCH, [url, headers])
    assert "error" in out and "Failed to fetch" in out["error"], out


def test_the_page_attaches_an_image_for_a_model_that_reads_them(page, vision_server, server, tmp_path):
    """A vision model's page offers to attach images; the picture goes as an `image_url` part
    (a data URL read in the browser), shows in the user's bubble, and the reply is the API's
    for the same image and question. A text model's page offers no such button."""
    import base64
    import io

    import numpy as np
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(7).integers(0, 255, (80, 100, 3), dtype=np.uint8)).save(buf, "PNG")
    (tmp_path / "picture.png").write_bytes(buf.getvalue())
    question = "What is in this image?"

    page.goto(f"{server.root}/")
    page.wait_for_function("document.getElementById('model').textContent !== '…'")
    page.wait_for_load_state("networkidle")
    assert page.locator("#attach").is_hidden() and page.locator("#takes-images").is_hidden()

    page.goto(f"{vision_server.root}/")
    page.wait_for_selector("#attach:visible")
    assert page.locator("#takes-images").is_visible()
    page.click("#new-chat")
    page.fill("#max_tokens", "8")
    page.fill("#temperature", "0")
    page.set_input_files("#attach-files", str(tmp_path / "picture.png"))
    page.wait_for_selector("#attached img.thumb")
    page.fill("#prompt", question)
    with page.expect_request("**/v1/chat/completions") as sent:
        page.press("#prompt", "Enter")
    content = json.loads(sent.value.post_data)["messages"][-1]["content"]
    url = f"data:image/png;base64,{base64.b64encode(buf.getvalue()).decode()}"
    assert content == [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": question}]
    page.wait_for_selector(".msg.assistant .stats:has-text('tokens')", timeout=120_000)
    assert page.locator(".msg.user img.thumb").count() == 1 and page.locator("#attached img").count() == 0
    answer = page.evaluate("JSON.parse(localStorage.getItem('mlxpipe.chat.v1')).turns[1].content")
    api = httpx.post(f"{vision_server.base_url}/chat/completions", timeout=60, json={
        "model": "default", "max_tokens": 8, "temperature": 0, "messages": [{"role": "user", "content": content}]})
    assert answer and answer == api.json()["choices"][0]["message"]["content"]
    page.click("#new-chat")
