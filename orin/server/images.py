"""Images of chat requests: ``image_url`` content parts into RGB pixels.

A part's URL is a ``data:`` URL (base64), always accepted, or an ``http(s)``
URL whose host the profile lists in ``server.image_url_hosts`` (none by
default: the server never fetches a URL a client chose). Fetches do not follow
redirects and stop at ``server.max_image_bytes`` and ``FETCH_TIMEOUT_S``.

Pillow decodes the common formats only; the pixel count
(``server.max_image_pixels``) is checked from the header, before any pixel is
decoded, so a small file that inflates to a huge bitmap is refused cheaply.
A data: URL's base64 and every image's pixels are decoded on a worker thread;
a request cancelled meanwhile (its client left) stops that decode at its next
block of encoded data (``DECODE_BLOCK``) or step, rather than finish it for
nobody: a 16-megapixel PNG takes about 0.3 s to decode on one core.
Every failure is a 400 naming the content part, e.g.
``messages[0].content[1].image_url``.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import threading
from dataclasses import dataclass
from urllib.parse import urlsplit

import httpx
from PIL import Image, UnidentifiedImageError

from orin.engine.vision import RGBImage
from orin.profile.schema import ServerSection
from orin.server.errors import ApiError

FORMATS = ("PNG", "JPEG", "GIF", "WEBP", "BMP")
FETCH_TIMEOUT_S = 10.0
# encoded bytes Pillow decodes between two looks at the request's cancellation: at
# most ~4 MB of pixels out of the densest zlib stream (a PNG), tens of ms of work
DECODE_BLOCK = 4096

# server.max_image_pixels (up to 256 megapixels), which ``decode`` checks from the
# header before any pixel is decoded, replaces Pillow's decompression-bomb limit (89
# megapixels: a warning, and an error at twice that), which would refuse with its own
# message, and refuse images a profile allows. Pillow reads its limit from one
# process-wide setting at each of its checks: it is set here, once, when the server's
# image code is imported, and never from a request's thread. ``decode`` is the only
# code of the server that opens an image it did not make.
Image.MAX_IMAGE_PIXELS = None


class BadImage(ApiError):
    """An image part that cannot be used: broken, too large, or not allowed."""

    status, type, code = 400, "invalid_request_error", "invalid_image"


class DecodeStopped(Exception):
    """The request was cancelled while its image was decoded: nobody wants the pixels."""


class _Reader(io.BytesIO):
    """The encoded image as Pillow reads it, a block at a time: a read once ``stop``
    is set ends the decode (Pillow lets the exception through)."""

    def __init__(self, raw: bytes, stop: threading.Event) -> None:
        super().__init__(raw)
        self.stop = stop

    def read(self, size: int | None = -1, /) -> bytes:
        _check(self.stop)
        return super().read(size)


@dataclass(frozen=True)
class ImageLimits:
    max_bytes: int = 8 * 1024 * 1024
    max_pixels: int = 16_777_216
    hosts: frozenset[str] = frozenset()
    timeout_s: float = FETCH_TIMEOUT_S
    max_request_pixels: int = 33_554_432  # all the images of one request together

    @classmethod
    def from_server(cls, server: ServerSection) -> ImageLimits:
        return cls(
            max_bytes=server.max_image_bytes,
            max_pixels=server.max_image_pixels,
            hosts=frozenset(h.lower() for h in server.image_url_hosts),
            max_request_pixels=server.max_request_image_pixels,
        )


async def load(
    url: str,
    limits: ImageLimits,
    param: str,
    transport: httpx.AsyncBaseTransport | None = None,
    pixels_left: int | None = None,
) -> RGBImage:
    """The image a part's URL names, decoded within ``limits``; BadImage naming
    ``param`` otherwise. ``transport``: for tests, a fetch without sockets.
    ``pixels_left``: what the request's earlier images left of
    ``limits.max_request_pixels`` (checked from the header, as the image's own limit)."""
    scheme = url.split(":", 1)[0].lower() if ":" in url[:8] else ""
    source: str | bytes
    if scheme == "data":
        source = url  # its base64 is decoded on the worker thread too
    elif scheme in ("http", "https"):
        source = await fetch(url, limits, param, transport)
    else:
        raise BadImage("an image URL must be a data: URL (base64) or an http(s) URL", param)
    stop = threading.Event()
    try:  # off the loop: megabytes of base64 and pixels take tens of ms to hundreds
        return await asyncio.to_thread(_decode, source, limits, param, pixels_left, stop)
    except asyncio.CancelledError:  # the worker thread cannot be cancelled: told to stop
        stop.set()
        raise


def _decode(
    source: str | bytes,
    limits: ImageLimits,
    param: str,
    pixels_left: int | None,
    stop: threading.Event,
) -> RGBImage:
    raw = from_data_url(source, limits, param) if isinstance(source, str) else source
    return decode(raw, limits, param, pixels_left, stop)


def from_data_url(url: str, limits: ImageLimits, param: str) -> bytes:
    """The bytes of a ``data:[<type>];base64,<data>`` URL, size checked before decoding."""
    header, comma, payload = url[5:].partition(",")
    if not comma or not header.lower().endswith(";base64"):
        raise BadImage("an image data: URL must be base64 (data:image/png;base64,...)", param)
    payload = "".join(payload.split())
    payload += "=" * (-len(payload) % 4)  # unpadded (Go's RawStdEncoding), as llama-server takes
    if len(payload) // 4 * 3 > limits.max_bytes + 2:
        raise _too_large(limits, param)
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise BadImage(f"the image's base64 data does not decode: {exc}", param) from exc
    if len(raw) > limits.max_bytes:
        raise _too_large(limits, param)
    return raw


async def fetch(
    url: str,
    limits: ImageLimits,
    param: str,
    transport: httpx.AsyncBaseTransport | None = None,
) -> bytes:
    """An image from a host the profile lists, within the byte and time limits: the
    time limit is for the whole fetch, so a server that sends a byte now and then
    cannot hold the request past it."""
    host = (urlsplit(url).hostname or "").lower()
    if host not in limits.hosts:
        allowed = ", ".join(sorted(limits.hosts)) or "none: send the image as a data: URL"
        raise BadImage(
            f"this server does not fetch images from {host or 'that URL'} "
            f"(server.image_url_hosts: {allowed})",
            param,
        )
    try:
        return await asyncio.wait_for(_get(url, limits, param, transport), limits.timeout_s)
    except asyncio.TimeoutError as exc:
        raise BadImage(
            f"fetching the image failed: {host} sent no whole image within {limits.timeout_s:g} s",
            param,
        ) from exc
    except httpx.HTTPError as exc:
        reason = str(exc) or type(exc).__name__
        raise BadImage(f"fetching the image from {host} failed: {reason}", param) from exc


async def _get(
    url: str, limits: ImageLimits, param: str, transport: httpx.AsyncBaseTransport | None
) -> bytes:
    async with (
        httpx.AsyncClient(
            timeout=limits.timeout_s, follow_redirects=False, transport=transport
        ) as client,
        client.stream("GET", url) as response,
    ):
        if response.is_redirect:
            raise BadImage(
                f"fetching the image failed: HTTP {response.status_code}, a redirect "
                "(redirects are not followed: name the image's own URL)",
                param,
            )
        if response.status_code != 200:
            raise BadImage(f"fetching the image failed: HTTP {response.status_code}", param)
        size = response.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > limits.max_bytes:
            raise _too_large(limits, param)
        data = bytearray()
        async for block in response.aiter_bytes():
            data += block
            if len(data) > limits.max_bytes:
                raise _too_large(limits, param)
        return bytes(data)


def decode(
    raw: bytes,
    limits: ImageLimits,
    param: str,
    pixels_left: int | None = None,
    stop: threading.Event | None = None,
) -> RGBImage:
    """Encoded image bytes into RGB pixels (the first frame of an animation), within
    the image's pixel limit and what is left of the request's (``pixels_left``).
    DecodeStopped once ``stop`` is set: between blocks of ``DECODE_BLOCK`` encoded
    bytes and between the steps (a WebP frame is decoded in one call of libwebp)."""
    stop = stop or threading.Event()
    try:
        img = Image.open(_Reader(raw, stop), formats=FORMATS)
        img.decodermaxblock = DECODE_BLOCK
        width, height = img.size
        if width * height > limits.max_pixels:
            raise BadImage(
                f"the image is {width}x{height} pixels; at most {limits.max_pixels} "
                "(server.max_image_pixels)",
                param,
            )
        if pixels_left is not None and width * height > pixels_left:
            raise BadImage(
                f"the request's images come to more than {limits.max_request_pixels} "
                f"pixels together (server.max_request_image_pixels); this one, "
                f"{width}x{height}, is past it",
                param,
            )
        img.load()
        _check(stop)
        pixels: Image.Image = img
        if img.mode.startswith("I;16"):  # 16-bit grey: convert() would clip it at 255
            pixels = img.point(lambda v: v / 256)  # its high byte, as stb_image reads it
        rgb = pixels if pixels.mode == "RGB" else pixels.convert("RGB")
        _check(stop)
    except (BadImage, DecodeStopped):
        raise
    except UnidentifiedImageError as exc:
        raise BadImage(
            f"the image cannot be decoded: not a {', '.join(FORMATS)} image", param
        ) from exc
    except (OSError, SyntaxError, ValueError, Image.DecompressionBombError) as exc:
        # (Pillow's own limit only where something in the process set it again)
        raise BadImage(f"the image cannot be decoded: {exc}", param) from exc
    if width < 1 or height < 1:
        raise BadImage("the image has no pixels", param)
    return RGBImage(width, height, rgb.tobytes())


def _check(stop: threading.Event) -> None:
    if stop.is_set():
        raise DecodeStopped


def _too_large(limits: ImageLimits, param: str) -> BadImage:
    return BadImage(
        f"the image is larger than {limits.max_bytes} bytes (server.max_image_bytes)", param
    )
