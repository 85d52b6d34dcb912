"""Images on every API of a served vision model (a tiny Qwen2.5-VL on 2 stages): the
openai SDK's ``image_url``, the anthropic SDK's ``image`` block, the ollama client's
``images`` and the Responses API's ``input_image`` give the same answer for the same
image and question; hostile images get a 4xx that names the problem within a second,
the server stays healthy and no frame reaches a stage; a text model says it takes none."""

from __future__ import annotations

import base64
import io
import struct
import threading
import time
import zlib
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import numpy as np
import pytest

pytest.importorskip("mlx_vlm")


QUESTION = "What is in this image?"


def png(seed: int = 0, size=(100, 120)) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (*size, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def bomb(width: int = 20000, height: int = 20000) -> bytes:
    """A PNG of a few dozen bytes whose header claims ``width`` x ``height`` pixels."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")


class _Slow(BaseHTTPRequestHandler):
    """/slow: headers, then nothing for 30 s; /huge: an endless body; /png: an image."""

    def do_GET(self):  # noqa: N802 - http.server's name
        if self.path == "/png":
            body = png(5)
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        self.send_response(200)
        self.end_headers()
        try:
            if self.path == "/slow":
                time.sleep(30)
            while self.path == "/huge":
                self.wfile.write(b"\0" * (1 << 16))
        except OSError:
            pass

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def image_host():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Slow)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


def test_every_protocol_gives_the_same_answer(vision_server):
    import anthropic
    import ollama
    from openai import OpenAI

    image = png(1)
    b64 = base64.b64encode(image).decode()
    client = OpenAI(base_url=vision_server.base_url, api_key="none")
    chat = client.chat.completions.create(model="default", max_tokens=12, messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(image)}}, {"type": "text", "text": QUESTION}]}])
    responses = client.responses.create(model="default", max_output_tokens=12, input=[{"role": "user", "content": [
        {"type": "input_image", "image_url": data_url(image)}, {"type": "input_text", "text": QUESTION}]}])
    message = anthropic.Anthropic(base_url=vision_server.root, api_key="none").messages.create(
        model="default", max_tokens=12, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64}},
            {"type": "text", "text": QUESTION}]}])
    olla = ollama.Client(host=vision_server.root).chat(
        model="default", messages=[{"role": "user", "content": QUESTION, "images": [b64]}], options={"num_predict": 12})
    answers = [chat.choices[0].message.content, responses.output_text, message.content[0].text, olla.message.content]
    assert answers[0] and all(a == answers[0] for a in answers), answers
    assert chat.usage.completion_tokens == 12 and chat.usage.prompt_tokens > 16  # the image's 16 placeholders
    other = client.chat.completions.create(model="default", max_tokens=12, messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(png(2))}}, {"type": "text", "text": QUESTION}]}])
    assert other.choices[0].message.content != answers[0]  # the image matters
    # The image again, by URL (this server fetches them, from loopback too): the same answer.
    models = httpx.get(f"{vision_server.base_url}/models").json()["data"][0]
    assert models["input_modalities"] == ["text", "image"]
    show = httpx.post(f"{vision_server.root}/api/show", json={"model": "default"}).json()
    assert "vision" in show["capabilities"]


def test_an_image_by_url_and_two_in_one_conversation(vision_server, image_host):
    from openai import OpenAI

    client = OpenAI(base_url=vision_server.base_url, api_key="none")
    by_url = client.chat.completions.create(model="default", max_tokens=8, messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": f"{image_host}/png"}}, {"type": "text", "text": QUESTION}]}])
    inline = client.chat.completions.create(model="default", max_tokens=8, messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(png(5))}}, {"type": "text", "text": QUESTION}]}])
    assert by_url.choices[0].message.content == inline.choices[0].message.content
    turns = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(png(5))}},
                                          {"type": "text", "text": QUESTION}]},
             {"role": "assistant", "content": inline.choices[0].message.content},
             {"role": "user", "content": [{"type": "text", "text": "And this one?"},
                                          {"type": "image_url", "image_url": {"url": data_url(png(6))}}]}]
    second = client.chat.completions.create(model="default", max_tokens=8, messages=turns)
    assert second.usage.prompt_tokens_details.cached_tokens >= 16  # the first turn's image: its blocks are hits


def _stage_frames(srv) -> list:
    return [s["frames"] for s in httpx.get(f"{srv.root}/health").json()["stages"]]


HOSTILE = {
    "not an image": (lambda host: data_url(b"this is plain text, not a picture"), "not an image"),
    "truncated": (lambda host: data_url(png(3)[:600]), "truncated"),
    "a decompression bomb": (lambda host: data_url(bomb()), "pixels"),
    "over the byte limit": (lambda host: data_url(b"\0" * (2 << 20)), "bytes"),
    "not base64": (lambda host: "data:image/png;base64,@@@notbase64@@@", "base64"),
    "a slow URL": (lambda host: f"{host}/slow", "within"),
    "a huge URL": (lambda host: f"{host}/huge", "bytes"),
    "another scheme": (lambda host: "file:///etc/passwd", "data URL"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_images_get_a_4xx_within_a_second(vision_server, image_host, case):
    make, words = HOSTILE[case]
    before = _stage_frames(vision_server)
    t0 = time.monotonic()
    r = httpx.post(f"{vision_server.base_url}/chat/completions", timeout=30, json={
        "model": "default", "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": make(image_host)}}, {"type": "text", "text": "Hi"}]}]})
    took = time.monotonic() - t0
    assert 400 <= r.status_code < 500 and words in r.json()["error"]["message"], r.text
    assert r.json()["error"]["message"].startswith("messages.0.content.0: ")
    assert took < 1.0, took
    assert httpx.get(f"{vision_server.root}/health").status_code == 200
    assert _stage_frames(vision_server) == before  # nothing reached a stage


def test_too_many_images_and_raw_prompts(vision_server):
    four = [{"type": "image_url", "image_url": {"url": data_url(png(i))}} for i in range(4)]
    r = httpx.post(f"{vision_server.base_url}/chat/completions", timeout=30, json={
        "model": "default", "messages": [{"role": "user", "content": four}]})
    assert r.status_code == 400 and "at most 3" in r.json()["error"]["message"]
    r = httpx.post(f"{vision_server.root}/api/generate", timeout=30, json={
        "model": "default", "prompt": "Hi", "raw": True, "images": [base64.b64encode(png(1)).decode()]})
    assert r.status_code == 400 and "raw" in r.text


def test_a_text_model_refuses_images(default_server):
    image = data_url(png(1))
    r = httpx.post(f"{default_server.base_url}/chat/completions", timeout=30, json={
        "model": "default", "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": image}}, {"type": "text", "text": "Hi"}]}]})
    assert r.status_code == 400 and "takes text only" in r.json()["error"]["message"]
    r = httpx.post(f"{default_server.root}/v1/messages", timeout=30, json={
        "model": "default", "max_tokens": 8, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(png(1)).decode()}}]}]})
    assert r.status_code == 400 and "takes text only" in r.text
    assert httpx.get(f"{default_server.base_url}/models").json()["data"][0]["input_modalities"] == ["text"]


def test_private_addresses_and_unfetched_urls_are_refused():
    """The URL policy, on its own: no fetching unless allowed, and never from a private,
    loopback or link-local address unless that is allowed too."""
    import asyncio

    from mlxpipe.server.api.errors import ApiError
    from mlxpipe.server.api.images import ImagePolicy, load_images
    from mlxpipe.server.api.request import ImageRef

    def refused(url: str, **policy) -> str:
        base = dict(max_images=4, max_bytes=1 << 20, max_pixels=1 << 22, fetch_urls=True, private_urls=False,
                    fetch_timeout_s=1.0) | policy
        with pytest.raises(ApiError) as err:
            asyncio.run(load_images([ImageRef(url, "image")], ImagePolicy(**base)))
        return err.value.message

    assert "does not fetch image URLs" in refused("https://example.com/a.png", fetch_urls=False)
    for url in ("http://127.0.0.1/a.png", "http://10.1.2.3/a.png", "http://169.254.169.254/latest",
                "http://[::1]/a.png", "http://192.168.0.1/x"):
        assert "private or local address" in refused(url), url
    assert "private or local address" in refused("http://localhost/a.png")  # a name that resolves to loopback
