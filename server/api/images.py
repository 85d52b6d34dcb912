"""Images as clients send them, checked at the door and decoded.

Every protocol's translator turns an image it was sent into an ``ImageRef`` (the
string the client sent: a data URL, an http(s) URL, or bare base64, with where in
the request it was) and a ``{"type": "image"}`` part of the message's content, in
order. ``load_images`` then does the rest, before anything reaches the model:

- how many: at most ``max_images`` a request;
- bytes: base64 that decodes, at most ``max_image_bytes`` (checked on the base64's
  length before decoding, and on what a URL sends as it arrives);
- URLs: fetched only where the operator allows it (``--image-urls``), never from a
  loopback, private, link-local or otherwise reserved address unless allowed too
  (``--image-private-urls``; checked on every address the name resolves to, and again
  after each redirect), within ``image_fetch_timeout_s`` for the whole transfer;
- the image: a format Pillow reads (PNG, JPEG, WebP, GIF, BMP), whose size, read
  from its header before any pixel is decoded, is at most ``max_image_pixels`` (a
  small file that claims a huge canvas, a decompression bomb, costs nothing), and
  whose data decodes whole (a truncated file is refused, not padded).

Each failure is an ``ApiError`` 400 that names the image (``param``) and what to
change. Decoding runs in a worker thread.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import ipaddress
import re
import socket
from dataclasses import dataclass
from typing import List, Sequence
from urllib.parse import urljoin, urlsplit

from mlxpipe.server.api.errors import ApiError
from mlxpipe.server.api.request import ImageRef

FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
MAX_REDIRECTS = 3
_DATA_URL = re.compile(r"^data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<params>(?:;[\w.+-]+=[\w.+-]+)*)(?P<b64>;base64)?,",
                       re.IGNORECASE)


@dataclass(frozen=True)
class ImagePolicy:
    """What a request's images may be (``ApiOptions``'s image knobs)."""

    max_images: int
    max_bytes: int
    max_pixels: int
    fetch_urls: bool
    private_urls: bool
    fetch_timeout_s: float

    @classmethod
    def of(cls, options) -> "ImagePolicy":
        return cls(options.max_images, options.max_image_bytes, options.max_image_pixels, options.image_urls,
                   options.image_private_urls, options.image_fetch_timeout_s)


def _bad(ref: ImageRef, why: str) -> ApiError:
    return ApiError(400, f"{ref.param}: {why}", param=ref.param, code="invalid_image")


def _b64(ref: ImageRef, payload: str, policy: ImagePolicy) -> bytes:
    if len(payload) * 3 // 4 > policy.max_bytes:
        raise _bad(ref, f"the image is about {len(payload) * 3 // 4} bytes; this server takes at most "
                        f"{policy.max_bytes} an image")
    try:
        return base64.b64decode(re.sub(r"\s+", "", payload), validate=True)
    except (binascii.Error, ValueError):
        raise _bad(ref, "the image's base64 does not decode") from None


def _data_url(ref: ImageRef, policy: ImagePolicy) -> bytes:
    m = _DATA_URL.match(ref.source)
    if m is None or not m.group("b64"):
        raise _bad(ref, "a data URL for an image is data:<type>;base64,<data>")
    if m.group("mime") and not m.group("mime").lower().startswith("image/"):
        raise _bad(ref, f"the data URL holds {m.group('mime')}, not an image")
    return _b64(ref, ref.source[m.end():], policy)


def _public(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    if getattr(ip, "ipv4_mapped", None) is not None:
        ip = ip.ipv4_mapped
    return not (ip.is_private or ip.is_loopback or ip.is_link_local or ip.is_reserved or ip.is_multicast
                or ip.is_unspecified)


async def _check_host(ref: ImageRef, url: str, policy: ImagePolicy) -> None:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise _bad(ref, f"an image URL is http(s)://host/..., not {url[:80]!r}")
    if policy.private_urls:
        return
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(parts.hostname, parts.port or 443, type=socket.SOCK_STREAM)
    except OSError as err:
        raise _bad(ref, f"the image URL's host {parts.hostname} does not resolve ({err})") from None
    private = sorted({i[4][0] for i in infos if not _public(i[4][0])})
    if private:
        raise _bad(ref, f"the image URL's host {parts.hostname} is at {private[0]}, a private or local address, "
                        "which this server does not fetch from")


async def _fetch(ref: ImageRef, policy: ImagePolicy) -> bytes:
    if not policy.fetch_urls:
        raise _bad(ref, "this server does not fetch image URLs (its operator allows them with --image-urls); "
                        "send the image as a data URL (data:image/png;base64,...)")
    import httpx

    try:
        return await asyncio.wait_for(_get(ref, ref.source, policy, httpx), policy.fetch_timeout_s)
    except asyncio.TimeoutError:
        raise _bad(ref, f"the image URL sent no whole image within {policy.fetch_timeout_s:g} s") from None
    except httpx.HTTPError as err:
        raise _bad(ref, f"the image URL could not be fetched: {type(err).__name__}: {err}") from None


async def _get(ref: ImageRef, url: str, policy: ImagePolicy, httpx) -> bytes:
    async with httpx.AsyncClient(follow_redirects=False, timeout=policy.fetch_timeout_s, trust_env=False) as client:
        for _ in range(MAX_REDIRECTS + 1):
            await _check_host(ref, url, policy)
            async with client.stream("GET", url) as r:
                if r.is_redirect and "location" in r.headers:
                    url = urljoin(url, r.headers["location"])
                    continue
                if r.status_code != 200:
                    raise _bad(ref, f"the image URL answered HTTP {r.status_code}")
                size = int(r.headers.get("content-length") or 0)
                if size > policy.max_bytes:
                    raise _bad(ref, f"the image URL's image is {size} bytes; this server takes at most "
                                    f"{policy.max_bytes}")
                got = bytearray()
                async for chunk in r.aiter_bytes():
                    got += chunk
                    if len(got) > policy.max_bytes:
                        raise _bad(ref, f"the image URL sent more than {policy.max_bytes} bytes, the most this "
                                        "server takes")
                return bytes(got)
        raise _bad(ref, f"the image URL redirected more than {MAX_REDIRECTS} times")


async def _bytes(ref: ImageRef, policy: ImagePolicy) -> bytes:
    src = ref.source.strip()
    if ref.base64:
        return _b64(ref, src, policy)
    if src[:5].lower() == "data:":
        return _data_url(ref, policy)
    if src[:7].lower() == "http://" or src[:8].lower() == "https://":
        return await _fetch(ref, policy)
    raise _bad(ref, "an image is a data URL (data:image/png;base64,...) or an http(s) URL")


def decode(ref: ImageRef, data: bytes, policy: ImagePolicy):
    """The image in ``data``, RGB and upright (its EXIF orientation applied), decoded whole; its
    size checked from its header first."""
    from PIL import Image, ImageOps, UnidentifiedImageError

    try:
        im = Image.open(io.BytesIO(data))
    except (UnidentifiedImageError, Image.DecompressionBombError, OSError, ValueError) as err:
        why = (f"its header claims more pixels than Pillow opens; this server takes at most {policy.max_pixels}"
               if isinstance(err, Image.DecompressionBombError) else f"not an image ({', '.join(FORMATS)})")
        raise _bad(ref, why) from None
    if im.format not in FORMATS:
        raise _bad(ref, f"a {im.format} image; this server takes {', '.join(FORMATS)}")
    w, h = im.size
    if w * h > policy.max_pixels:
        raise _bad(ref, f"the image is {w} x {h} = {w * h} pixels; this server takes at most {policy.max_pixels}")
    if w < 1 or h < 1:
        raise _bad(ref, f"the image is {w} x {h} pixels")
    try:
        im.load()
        return ImageOps.exif_transpose(im).convert("RGB")  # upright as a camera took it, as mlx-vlm's load_image
    except (OSError, ValueError, SyntaxError) as err:
        raise _bad(ref, f"the image data is truncated or corrupt ({err})") from None


async def load_images(refs: Sequence[ImageRef], policy: ImagePolicy) -> List:
    """Every image of a request, checked and decoded (PIL images, RGB), in order; or an
    ``ApiError`` 400 naming the first that cannot be taken."""
    if len(refs) > policy.max_images:
        raise ApiError(400, f"the request holds {len(refs)} images; this server takes at most {policy.max_images}",
                       param=refs[policy.max_images].param, code="too_many_images")
    raw = [await _bytes(ref, policy) for ref in refs]
    return await asyncio.to_thread(lambda: [decode(ref, data, policy) for ref, data in zip(refs, raw)])
