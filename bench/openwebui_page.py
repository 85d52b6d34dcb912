"""Open WebUI's page, driven in headless Chromium (Playwright on the system's
Chromium, launched as ``tests/test_browser.py`` launches it; ``MLXPIPE_CHROMIUM``
names another binary): mlxpipe's model picked in the model menu, a text file
attached to the chat, a question sent, the answer watched as it streams in. The
page's element ids and labels are Open WebUI 0.12's."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import Callable, Dict

CHROMIUM = os.environ.get("MLXPIPE_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def _browser(pw):
    if not (os.path.exists(CHROMIUM) or shutil.which(CHROMIUM)):
        raise SystemExit(f"mlxpipe bench openwebui: no Chromium at {CHROMIUM}: `apt-get install -y chromium`, "
                         "or point MLXPIPE_CHROMIUM at a Chromium or Chrome binary")
    return pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)


def _dismiss(page) -> None:
    """Close what Open WebUI shows on a first visit (the release notes)."""
    for label in ("Okay, Let's Go!", "Okay, Let’s Go!"):
        button = page.get_by_role("button", name=label)
        if button.count() and button.first.is_visible():
            button.first.click()


def pick_model(page, model: str) -> None:
    """``model`` chosen in the model menu (it lists mlxpipe's embedding model too)."""
    page.locator("#model-selector-model-button").click()
    page.locator(f'button[data-value="{model}"]').click()
    page.wait_for_function("m => (document.querySelector('#model-selector-model-button')?.textContent || '')"
                           ".includes(m)", arg=model)


def attach(page, path: Path, timeout_ms: float) -> None:
    """The file into the chat's input (its hidden file input, as the + menu's "Upload
    Files" fills it), then wait until Open WebUI has processed it (chunked and
    embedded): its chip in the input shows and stops spinning."""
    with page.expect_response(lambda r: "/api/v1/files/" in r.url and r.request.method == "POST",
                              timeout=timeout_ms) as posted:
        page.locator('input[type="file"]:not(#camera-input)').first.set_input_files(str(path))
    if not posted.value.ok:
        raise RuntimeError(f"Open WebUI refused the upload: HTTP {posted.value.status} {posted.value.text()[:300]}")
    page.locator("form").get_by_text(path.name).first.wait_for(state="visible", timeout=timeout_ms)
    page.wait_for_timeout(500)
    page.wait_for_function("() => !document.querySelector('form [class*=\"spin\"]')", timeout=timeout_ms)


def send(page, question: str) -> None:
    page.locator("#chat-input").click()
    page.keyboard.type(question)
    page.locator("#send-message-button").click()


ANSWER = """() => {
  const all = [...document.querySelectorAll('#response-content-container')];
  if (!all.length) return '';
  const copy = all[all.length - 1].cloneNode(true);
  copy.querySelectorAll('button').forEach(b => b.remove());   // "1 Source" and the like
  return copy.textContent.replace(/\\s+/g, ' ').trim();
}"""


def watch_answer(page, timeout_s: float) -> dict:
    """Read the assistant's message every 250 ms until it is done (the page's Stop
    button gone and the text still): how often its text grew, and when it first showed."""
    started = time.monotonic()
    first, growths, text, still = None, 0, "", 0
    while time.monotonic() - started < timeout_s:
        now = page.evaluate(ANSWER)
        generating = page.locator('button[aria-label="Stop"]').count() > 0
        if len(now) > len(text):
            growths += 1
            first = first or time.monotonic() - started
            text, still = now, 0
        elif not generating:
            still += 1
            if still >= 8:
                break
        page.wait_for_timeout(250)
    return {"answer": text, "growths": growths, "first_text_s": first}


def drive(url: str, model: str, doc: Path, question: str, snapshots: Dict, counters: Callable[[], dict],
          timeout_s: float, work: Path) -> dict:
    """The whole visit; ``snapshots`` gets mlxpipe's counters (``counters()``) once the
    file is processed ("uploaded") and once the answer is in ("answered")."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        raise SystemExit("mlxpipe bench openwebui needs the `playwright` package: pip install 'playwright>=1.40' "
                         "(no `playwright install`: the system's Chromium is used)") from None

    timings: Dict[str, float] = {}
    with sync_playwright() as pw:
        browser = _browser(pw)
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.set_default_timeout(timeout_s * 1000)
        try:
            t = time.monotonic()
            page.goto(url)
            page.locator("#chat-input").wait_for(state="visible")
            page.wait_for_timeout(1000)
            _dismiss(page)
            timings["page loaded"] = time.monotonic() - t
            pick_model(page, model)
            t = time.monotonic()
            attach(page, doc, timeout_s * 1000)
            timings["file attached and processed"] = time.monotonic() - t
            snapshots["uploaded"] = counters()
            t = time.monotonic()
            send(page, question)
            seen = watch_answer(page, timeout_s)
            timings["question to first text in the page"] = (seen["first_text_s"] or float("nan"))
            timings["question to answer done"] = time.monotonic() - t
            snapshots["answered"] = counters()
            page.screenshot(path=str(work / "answered.png"), full_page=True)
        except BaseException:
            page.screenshot(path=str(work / "failed.png"), full_page=True)
            print(f"the page as it was: {work / 'failed.png'}")
            raise
        finally:
            browser.close()
    return {"answer": seen["answer"], "growths": seen["growths"], "timings": timings}
