"""The page at `/`, driven in headless Chromium against a real server with two stages;
and a page on another origin calling the API with fetch, as a browser app would.

Needs Debian's Chromium (`apt-get install -y --no-install-recommends chromium`; on macOS
MLXPIPE_CHROMIUM pointing at Chromium or Chrome, else it skips) and the Python `playwright`
package (`pip install playwright`); `playwright install` is not needed, the system
browser is used.
"""

from __future__ import annotations

import functools
import json
import os
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
    shown = page.locator(".stage .layers").all_text_contents()
    assert shown == [f"[{a}, {b})" for a, b in (s["layers"] for s in health["stages"])]
    assert page.locator(".stage .address").all_text_contents() == [s["address"] for s in health["stages"]]
    assert health["model"] in page.locator("#model").text_content()

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
    assert body["stream"] is True and body["model"] == "default"
    assert body["messages"] == [{"role": "user", "content": "Write a short poem about the sea."}]
    assert body["max_tokens"] == 24 and body["temperature"] == 0 and body["top_p"] == 1
    assert "top_k" not in body and "seed" not in body and "stop" not in body   # unset: not sent
    assert page.locator(".msg.user").text_content() == "Write a short poem about the sea."
    reply = page.locator(".msg.assistant")

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
    # Every stage keeps the chat's prompt in its prefix cache, and the page shows the bytes.
    page.wait_for_function("[...document.querySelectorAll('.stage .prefix')].every(e => parseFloat(e.textContent) > 0)",
                           timeout=10_000)

    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "browser.png"), full_page=True)


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
