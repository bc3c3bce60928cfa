"""Image parts of chat requests: data: URLs and listed hosts decoded within limits,
everything else a 400 naming the content part (no sockets: fetches go through
httpx's MockTransport)."""

from __future__ import annotations

import asyncio
import base64
import io
import struct
import threading
import warnings
import zlib
from collections.abc import AsyncIterator

import httpx
import numpy as np
import pytest
from PIL import Image

from orin.engine.vision import MEDIA_MARKER
from orin.profile.schema import ServerSection
from orin.server import images
from orin.server.images import BadImage, ImageLimits
from orin.server.protocol import ChatCompletionRequest

PARAM = "messages[0].content[1].image_url"


def png(width: int = 8, height: int = 6, color: tuple[int, int, int] = (10, 20, 30)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (width, height), color).save(buf, "PNG")
    return buf.getvalue()


def data_url(raw: bytes, kind: str = "image/png") -> str:
    return f"data:{kind};base64," + base64.b64encode(raw).decode()


def load(url: str, limits: ImageLimits | None = None, transport: object = None) -> object:
    return asyncio.run(images.load(url, limits or ImageLimits(), PARAM, transport))  # type: ignore[arg-type]


def refused(url: str, limits: ImageLimits | None = None, transport: object = None) -> BadImage:
    with pytest.raises(BadImage) as info:
        load(url, limits, transport)
    assert info.value.param == PARAM and info.value.status == 400
    return info.value


def test_a_data_url_decodes_to_rgb_pixels() -> None:
    img = load(data_url(png(8, 6, (10, 20, 30))))
    assert (img.width, img.height) == (8, 6)  # type: ignore[attr-defined]
    assert img.pixels[:3] == bytes([10, 20, 30])  # type: ignore[attr-defined]
    assert len(img.pixels) == 8 * 6 * 3  # type: ignore[attr-defined]


def test_alpha_and_palette_images_become_rgb() -> None:
    buf = io.BytesIO()
    Image.new("RGBA", (4, 4), (1, 2, 3, 128)).save(buf, "PNG")
    assert len(load(data_url(buf.getvalue())).pixels) == 4 * 4 * 3  # type: ignore[attr-defined]
    buf = io.BytesIO()
    Image.new("P", (5, 3)).save(buf, "GIF")
    assert len(load(data_url(buf.getvalue(), "image/gif")).pixels) == 5 * 3 * 3  # type: ignore[attr-defined]


def test_a_16_bit_grey_image_keeps_its_shades() -> None:
    """A 16-bit greyscale PNG (a depth or thermal camera's) is scaled to 8 bits, its
    high byte as llama-server's stb_image takes it, not clipped at 255 to white."""
    grey = Image.new("I;16", (4, 1))
    grey.putdata([0, 256, 30000, 65535])
    buf = io.BytesIO()
    grey.save(buf, "PNG")
    img = load(data_url(buf.getvalue()))
    assert img.pixels == bytes([0] * 3 + [1] * 3 + [117] * 3 + [255] * 3)  # type: ignore[attr-defined]


def test_base64_without_padding_or_across_lines_is_accepted() -> None:
    """What other encoders write: no trailing '=' (Go's RawStdEncoding, Rust's
    STANDARD_NO_PAD), or MIME's 76-column lines."""
    raw = png(3, 3)
    encoded = base64.b64encode(raw).decode()
    assert encoded.endswith("=")
    assert load("data:image/png;base64," + encoded.rstrip("=")).width == 3  # type: ignore[attr-defined]
    assert load("data:image/png;base64," + base64.encodebytes(raw).decode()).width == 3  # type: ignore[attr-defined]
    assert "base64" in str(refused("data:image/png;base64," + encoded[:-3]))  # one char left


def test_broken_images_are_refused() -> None:
    assert "decoded" in str(refused(data_url(b"not an image at all")))
    assert "base64" in str(refused("data:image/png;base64,@@@@"))
    assert "base64" in str(refused("data:image/png," + "x" * 8))
    truncated = png(64, 64)[:60]
    refused(data_url(truncated))


def test_sizes_over_the_limits_are_refused() -> None:
    raw = png(16, 16)
    assert "max_image_bytes" in str(refused(data_url(raw), ImageLimits(max_bytes=len(raw) - 1)))
    assert "max_image_pixels" in str(refused(data_url(raw), ImageLimits(max_pixels=255)))
    load(data_url(raw), ImageLimits(max_bytes=len(raw), max_pixels=256))


class StopAfter(threading.Event):
    """A request cancelled once the decode has looked at it ``looks`` times."""

    def __init__(self, looks: int) -> None:
        super().__init__()
        self.looks, self.seen = looks, 0

    def is_set(self) -> bool:
        self.seen += 1
        return self.seen > self.looks or super().is_set()


def test_a_decode_stops_at_its_next_block_once_the_request_is_cancelled() -> None:
    """A decode whose request is cancelled midway stops at the next block of encoded
    data it reads, rather than decode the rest of the image for nobody."""
    noise = np.random.default_rng(0).integers(0, 256, (256, 256, 3), np.uint8)
    buf = io.BytesIO()
    Image.fromarray(noise).save(buf, "PNG")
    raw = buf.getvalue()
    assert len(raw) > 40 * images.DECODE_BLOCK
    whole = StopAfter(10**9)
    assert images.decode(raw, ImageLimits(), PARAM, stop=whole).width == 256
    assert whole.seen > 40  # one look per block at least
    midway = StopAfter(whole.seen // 2)
    with pytest.raises(images.DecodeStopped):
        images.decode(raw, ImageLimits(), PARAM, stop=midway)
    assert midway.seen == whole.seen // 2 + 1
    cancelled = threading.Event()
    cancelled.set()  # cancelled before the decode began: nothing is read
    with pytest.raises(images.DecodeStopped):
        images.decode(raw, ImageLimits(), PARAM, stop=cancelled)


def png_header(width: int, height: int) -> bytes:
    """A PNG that says it is width x height, with a few bytes of pixel data."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = zlib.crc32(kind + data) & 0xFFFFFFFF
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(bytes(1 + 3 * 64))
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


@pytest.mark.parametrize("size", [(10_000, 10_000), (20_000, 20_000), (2**31 - 1, 1)])
def test_an_image_past_pillows_own_limit_is_refused_by_max_image_pixels(
    size: tuple[int, int],
) -> None:
    """Pillow's decompression-bomb limit (89 megapixels) is not what refuses them:
    the message is the profile's, with the size read from the header."""
    message = str(refused(data_url(png_header(*size))))
    assert f"{size[0]}x{size[1]} pixels" in message and "max_image_pixels" in message
    assert "decompression bomb" not in message


@pytest.mark.parametrize("side", [10_000, 16_000])
def test_a_profile_may_allow_images_past_pillows_own_limit(side: int) -> None:
    """An image within a raised server.max_image_pixels is decoded, not refused by
    Pillow's 89-megapixel limit: no DecompressionBombWarning (10000x10000) and no
    DecompressionBombError past twice that (16000x16000, within the profile's 256
    megapixels); it is refused here for its missing rows."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        message = str(refused(data_url(png_header(side, side)), ImageLimits(max_pixels=2**28)))
    assert "truncated" in message and "decompression bomb" not in message
    assert not [w for w in caught if issubclass(w.category, Image.DecompressionBombWarning)]


def test_decoding_leaves_pillows_process_wide_setting_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Pillow's decompression-bomb limit is set once, when the server's image code is
    imported: a request's decode never writes that process-wide setting."""
    assert Image.MAX_IMAGE_PIXELS is None  # set by importing orin.server.images
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 10**12)
    load(data_url(png(8, 6)))
    assert Image.MAX_IMAGE_PIXELS == 10**12
    # set back by something else, Pillow's limit is still a 400, never a 500
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    limits = ImageLimits(max_pixels=2**28)
    assert "decompression bomb" in str(refused(data_url(png_header(100, 100)), limits))


def test_other_schemes_and_unlisted_hosts_are_refused() -> None:
    assert "data: URL" in str(refused("file:///etc/passwd"))
    assert "ftp" not in str(refused("ftp://example.com/a.png"))
    message = str(refused("https://example.com/a.png"))
    assert "image_url_hosts" in message and "data: URL" in message
    hosts = ImageLimits(hosts=frozenset({"images.example.com"}))
    assert "evil.example.com" in str(refused("http://evil.example.com/a.png", hosts))


def served(body: bytes, status: int = 200, headers: dict[str, str] | None = None) -> object:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(status, content=body, headers=headers)

    return httpx.MockTransport(handler)


def test_a_listed_host_is_fetched_within_the_limits() -> None:
    hosts = ImageLimits(hosts=frozenset({"images.example.com"}))
    url = "https://images.example.com/cat.png"
    img = load(url, hosts, served(png(4, 2)))
    assert (img.width, img.height) == (4, 2)  # type: ignore[attr-defined]
    small = ImageLimits(max_bytes=1024, hosts=hosts.hosts)
    assert "max_image_bytes" in str(refused(url, small, served(b"x" * 4096)))
    assert "HTTP 404" in str(refused(url, hosts, served(b"", 404)))
    redirect = served(b"", 302, {"location": "http://169.254.169.254/"})
    message = str(refused(url, hosts, redirect))  # redirects are not followed
    assert "HTTP 302" in message and "redirects are not followed" in message


def test_the_fetch_time_limit_is_for_the_whole_image() -> None:
    """A host that keeps sending a byte now and then is cut off at the limit, not
    given a fresh limit for every read."""

    async def trickle() -> AsyncIterator[bytes]:
        for _ in range(5000):  # 5 s at least, a hundred times the limit
            await asyncio.sleep(0.001)
            yield b"\0"

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=trickle())

    limits = ImageLimits(hosts=frozenset({"images.example.com"}), timeout_s=0.05)
    message = str(refused("https://images.example.com/a.png", limits, httpx.MockTransport(handler)))
    assert "within 0.05 s" in message


def test_a_failed_fetch_says_why() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("[Errno 111] Connection refused", request=request)

    limits = ImageLimits(hosts=frozenset({"images.example.com"}))
    message = str(refused("https://images.example.com/a.png", limits, httpx.MockTransport(handler)))
    assert "images.example.com" in message and "Connection refused" in message


def test_limits_come_from_the_server_section() -> None:
    server = ServerSection(
        image_url_hosts=["Images.Example.com"], max_image_bytes=4096, max_image_pixels=1000
    )
    limits = ImageLimits.from_server(server)
    assert limits == ImageLimits(4096, 1000, frozenset({"images.example.com"}))
    assert ServerSection().image_url_hosts == []
    limits = ImageLimits.from_server(ServerSection(max_request_image_pixels=5000))
    assert limits.max_request_pixels == 5000


def request_images(limits: ImageLimits, *sizes: tuple[int, int]) -> object:
    """The images of a chat request with one image part per size, as the route loads
    them (orin/server/app.py)."""
    from types import SimpleNamespace

    from orin.server.app import _images

    parts = [{"type": "image_url", "image_url": data_url(png(*size))} for size in sizes]
    body = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}, *parts]}]}
    )
    state = SimpleNamespace(engine=SimpleNamespace(supports_images=True), image_limits=limits)
    return asyncio.run(_images(state, body))  # type: ignore[arg-type]


def test_a_requests_images_together_stay_within_its_pixel_budget() -> None:
    """Each image within server.max_image_pixels, but so many that their pixels
    would fill the memory: the image past the request's budget is refused by its
    header, naming its part."""
    limits = ImageLimits(max_pixels=100 * 100, max_request_pixels=3 * 100 * 100)
    assert len(request_images(limits, (100, 100), (100, 100), (100, 100))) == 3  # type: ignore[arg-type]
    with pytest.raises(BadImage) as info:
        request_images(limits, (100, 100), (100, 100), (100, 100), (1, 1))
    assert info.value.param == "messages[0].content[4].image_url"
    message = str(info.value)
    assert "30000 pixels together" in message and "max_request_image_pixels" in message
    assert "1x1" in message


def test_image_parts_parse_in_the_openai_shape() -> None:
    body = ChatCompletionRequest.model_validate(
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "What is "},
                        {"type": "image_url", "image_url": {"url": "data:,", "detail": "low"}},
                        {"type": "text", "text": " and "},
                        {"type": "image_url", "image_url": "data:image/png;base64,AA=="},
                    ],
                },
            ]
        }
    )
    parts = body.image_parts()
    assert [p for p, _ in parts] == [
        "messages[1].content[1].image_url",
        "messages[1].content[3].image_url",
    ]
    assert parts[1][1].url == "data:image/png;base64,AA=="
    assert body.messages[1].text() == f"What is {MEDIA_MARKER} and {MEDIA_MARKER}"
    assert body.template_messages()[0]["content"] == "Be brief."
