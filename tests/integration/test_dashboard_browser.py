"""The dashboard in a real browser (Debian's chromium, driven by playwright) against a real
server on a generated model: the page loads without console errors, its charts and
slots follow the load, the playground streams, and with an API key the page is a
login form that refuses a wrong key and opens on the right one.

Playwright rather than selenium: it reports the page's console messages and uncaught
errors as events (selenium needs chromedriver's log API for that, which not every
chromedriver version serves), waits on the page's own state without a driver of a
matching version, and launches /usr/bin/chromium directly. It never downloads a
browser here: ``executable_path`` is Debian's, which ``make browser`` installs.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from orin.model import demo
from orin.server.state import ServerState
from tests import serverutil
from tests.serverutil import live_server
from tests.tools import make_note

pytestmark = pytest.mark.llama

CHROMIUM = Path("/usr/bin/chromium")
ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
PROFILE = """
engine: {n_ctx: 512, slots: 4, n_batch: 128, n_ubatch: 128}
server: {max_tokens_limit: 400}
"""
DEADLINE_S = 90.0  # generous: two shared cores may be busy with other work
KEY_ENV = "ORIN_LLM_TEST_DASHBOARD_KEY"

if TYPE_CHECKING:
    from playwright.sync_api import BrowserContext, Page


def _unavailable() -> str | None:
    if not CHROMIUM.exists():
        note = make_note("browser-unavailable.txt", "run `make browser` to install it")
        return f"no {CHROMIUM}: {note}"
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError as exc:
        return f"playwright is not installed ({exc}); pip install -e '.[dev]'"
    return None


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrowserContext]:
    """A fresh chromium profile for this module's pages."""
    reason = _unavailable()
    if reason is not None:
        print(f"browser tests skipped: {reason}")
        pytest.skip(reason)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        context = p.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("chromium-profile")),
            executable_path=str(CHROMIUM),
            args=ARGS,
            headless=True,
        )
        try:
            yield context
        finally:
            context.close()


@pytest.fixture(scope="module")
def server() -> Iterator[tuple[str, ServerState]]:
    with live_server(demo.ensure("tiny", "f16"), PROFILE, telemetry="auto") as s:
        yield s


@contextmanager
def watched_page(context: BrowserContext, base: str) -> Iterator[tuple[Page, list[str]]]:
    """A new page on the dashboard at ``base``, and the console errors and uncaught
    exceptions it reports."""
    page = context.new_page()
    errors: list[str] = []
    page.on(
        "console",
        lambda m: (
            errors.append(f"{m.text} ({m.location.get('url')})") if m.type == "error" else None
        ),
    )
    page.on("pageerror", lambda e: errors.append(str(e)))
    try:
        page.goto(base + "/")
        yield page, errors
    finally:
        page.close()


def poll(condition: Callable[[], Any], what: str, deadline_s: float = DEADLINE_S) -> Any:
    return serverutil.poll(condition, what, deadline_s)


def points(page: Page, chart: str) -> int:
    return int(page.locator(f"#chart-{chart}").get_attribute("data-points") or 0)


def page_max(page: Page, column: str) -> float:
    """The largest value of one history column the page holds."""
    value = page.evaluate(
        """(col) => {
            const s = window.orinDashboard && window.orinDashboard.store;
            if (!s || !s.cols) return 0;
            return Math.max(0, ...s.cols[col].filter((v) => v != null));
        }""",
        column,
    )
    return float(value)


@contextmanager
def load(base: str, headers: dict[str, str] | None = None) -> Iterator[list[str]]:
    """Streaming chat requests, four at a time, until the block ends; yields the texts."""
    stop = threading.Event()
    texts: list[str] = []

    def one() -> None:
        body = {
            "messages": [{"role": "user", "content": "Tell me about the board."}],
            "max_tokens": 300,
            "stream": True,
        }
        while not stop.is_set():
            with httpx.stream(
                "POST", f"{base}/v1/chat/completions", json=body, headers=headers, timeout=120
            ) as r:
                r.raise_for_status()
                texts.append("".join(line for line in r.iter_lines()))

    threads = [threading.Thread(target=one, daemon=True) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        yield texts
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=120)


def test_the_page_loads_without_console_errors(
    browser: BrowserContext, server: tuple[str, ServerState]
) -> None:
    base, state = server
    with watched_page(browser, base) as (page, errors):
        poll(lambda: points(page, "throughput") >= 1, "the first history row")
        rows = page.locator("#slots-body tr")
        poll(lambda: rows.count() == state.engine.cfg.slots, "a row per slot")
        assert page.locator("#model").text_content() == state.model_name
        assert page.locator("#conn").get_attribute("data-state") == "live"
        assert errors == []


def test_charts_and_slots_follow_the_load(
    browser: BrowserContext, server: tuple[str, ServerState]
) -> None:
    base, _ = server
    with watched_page(browser, base) as (page, errors):
        poll(lambda: points(page, "throughput") >= 1, "the first history row")
        before = points(page, "throughput")
        with load(base) as texts:
            poll(lambda: page_max(page, "tokens_per_s") > 0, "a second with generated tokens")
            poll(lambda: page_max(page, "slots_busy") > 0, "a second with a busy slot")
            poll(lambda: points(page, "throughput") > before, "more points in the chart")
            poll(lambda: page_max(page, "ttft_p95_ms") > 0, "a TTFT percentile")
            poll(lambda: texts, "a finished request")
        assert errors == []


def test_the_playground_streams_an_answer(
    browser: BrowserContext, server: tuple[str, ServerState]
) -> None:
    base, _ = server
    with watched_page(browser, base) as (page, errors):
        _chat(page, "Hello there")
        assert errors == []


def test_stop_before_the_first_token_gives_the_question_back(
    browser: BrowserContext, server: tuple[str, ServerState]
) -> None:
    base, _ = server
    with watched_page(browser, base) as (page, errors):
        first = _chat(page, "Hello there")
        held: list[Any] = []
        # the request is held at the browser's network layer, so no token can arrive
        # before Stop, however fast or loaded the machine is
        page.route("**/v1/chat/completions", lambda route: held.append(route))
        page.fill("#chat-input", "A question that is stopped")
        page.click("#chat-send")
        poll(lambda: page.locator(".msg").count() == 4, "the question and its empty answer")
        page.click("#chat-stop")
        poll(lambda: page.locator("#chat-send").is_enabled(), "the end of the request")
        assert page.locator(".msg").count() == 2  # only the first exchange stays
        assert page.locator(".msg.assistant").last.text_content() == first
        assert page.input_value("#chat-input") == "A question that is stopped"
        history = page.evaluate("() => window.orinDashboard.chat.messages")
        assert [m["role"] for m in history] == ["user", "assistant"]
        page.unroute("**/v1/chat/completions")
        page.click("#chat-send")  # the question, given back, goes again
        answer = page.locator(".msg.assistant").last
        poll(lambda: answer.get_attribute("data-streaming") == "false", "the second answer")
        history = page.evaluate("() => window.orinDashboard.chat.messages")
        assert [m["content"] for m in history if m["role"] == "user"] == [
            "Hello there",
            "A question that is stopped",
        ]
        assert page.input_value("#chat-input") == ""
        assert errors == []


def _chat(page: Page, text: str) -> str:
    page.fill("#chat-max", "24")
    page.fill("#chat-input", text)
    page.click("#chat-send")
    answer = page.locator(".msg.assistant").last
    poll(lambda: answer.get_attribute("data-streaming") == "false", "the end of the stream")
    reply = answer.text_content() or ""
    assert reply.strip() and "error" not in (answer.get_attribute("class") or "")
    assert page.locator(".msg.user").last.text_content() == text
    return reply


def test_board_charts_show_what_a_board_reports(
    browser: BrowserContext, server: tuple[str, ServerState]
) -> None:
    """GPU utilization by phase, power and temperatures are drawn when the server has
    them (here the server's own answer with a board's columns filled in), and absent,
    not zero, otherwise."""
    base, _ = server
    real = httpx.get(f"{base}/dashboard/data").json()
    assert all(v is None for v in real["history"]["gpu_util_decode"])  # a CPU-only host

    def board(route: Any) -> None:
        data = httpx.get(route.request.url).json()
        h = data["history"]
        n = len(h["t"])
        h["gpu_util_prefill"] = [0.97] * n
        h["gpu_util_decode"] = [0.55] * n
        h["power_w"] = [18.5] * n
        h["temp_c"] = {"gpu-thermal": [51.0] * n, "cpu-thermal": [48.5] * n}
        route.fulfill(json=data)

    with watched_page(browser, base) as (page, errors):
        poll(lambda: points(page, "throughput") >= 1, "the first history row")
        for chart in ("gpu", "power", "temp"):
            assert page.locator(f"#chart-{chart}").is_hidden()
        assert "GPU utilization" in (page.locator("#absent").text_content() or "")
        page.route("**/dashboard/data*", board)
        poll(lambda: points(page, "gpu") >= 1, "the GPU chart")
        for chart in ("gpu", "power", "temp"):
            assert page.locator(f"#chart-{chart}").is_visible()
        legend = page.locator("#chart-temp .u-legend").text_content() or ""
        assert "gpu-thermal" in legend and "cpu-thermal" in legend
        page.unroute("**/dashboard/data*")
        assert errors == []


def test_with_telemetry_off_the_page_says_so_not_that_a_source_lacks_a_counter(
    browser: BrowserContext, server: tuple[str, ServerState]
) -> None:
    """`serve --telemetry off` has no source at all: the GPU and power charts are absent
    because telemetry is off, not because a source has no GPU counter or rails."""
    base, _ = server
    absent = "#absent"

    def off(route: Any) -> None:
        data = httpx.get(route.request.url).json()
        data["telemetry"] = {"source": None, "phase": None}
        route.fulfill(json=data)

    with watched_page(browser, base) as (page, errors):
        poll(lambda: points(page, "throughput") >= 1, "the first history row")
        text = page.locator(absent).text_content() or ""
        assert "GPU utilization (no GPU counter in this telemetry source)" in text  # cpu
        page.route("**/dashboard/data*", off)
        said = lambda: page.locator(absent).text_content() or ""  # noqa: E731
        poll(lambda: "telemetry is off" in said(), "the page saying telemetry is off")
        assert "GPU utilization (telemetry is off)" in said()
        assert "power (telemetry is off)" in said() and "no GPU counter" not in said()
        assert page.locator("#tile-phase").text_content() == "telemetry off"
        page.unroute("**/dashboard/data*")
        assert errors == []


class FakeData:
    """A route answering /dashboard/data as a server started at ``started`` whose
    history has one row at each of ``ts`` (every figure 1.0, one thermal zone at
    50 °C), honouring ``since``; the rest of the answer is ``template``'s."""

    def __init__(self, template: dict[str, Any], started: float, ts: list[float]) -> None:
        self.template, self.started, self.ts = template, started, ts

    def __call__(self, route: Any) -> None:
        since = httpx.URL(route.request.url).params.get("since")
        rows = [t for t in self.ts if since is None or t > float(since)]
        h: dict[str, Any] = {"t": rows}
        for key in self.template["history"]:
            if key not in ("t", "temp_c"):
                h[key] = [1.0] * len(rows)
        h["temp_c"] = {"gpu-thermal": [50.0] * len(rows)}
        route.fulfill(json={**self.template, "started": self.started, "history": h})


def test_a_gap_and_a_restart_break_the_lines(
    browser: BrowserContext, server: tuple[str, ServerState]
) -> None:
    """Rows further apart than a few sampling intervals (the server or the tab asleep)
    get a row of nulls between them, where uPlot breaks its lines; a server that
    restarted (its start time changed) gets one however short the downtime, and the
    header says so. Hours of data keep only the server's history window."""
    base, _ = server
    template = httpx.get(f"{base}/dashboard/data").json()
    t0 = 1_700_000_000.0
    # the first server: five rows, then none for 60 s
    fake = FakeData(template, t0 - 10, [t0 + i for i in range(5)] + [t0 + 65])

    def column(page: Page, key: str = "tokens_per_s") -> list[Any]:
        """One column the page holds; empty before its first answer."""
        js = f"() => {{ const c = window.orinDashboard.store.cols; return c ? c.{key} : []; }}"
        return list(page.evaluate(js))

    browser.route("**/dashboard/data*", fake)  # from the page's first poll on
    try:
        with watched_page(browser, base) as (page, errors):
            poll(lambda: len(column(page, "t")) == 7, "the first server's rows and a gap")
            assert column(page) == [1.0] * 5 + [None, 1.0]
            assert column(page, "temp_c['gpu-thermal']") == [50.0] * 5 + [None, 50.0]
            assert t0 + 4 < column(page, "t")[5] < t0 + 65
            drawn = page.evaluate("() => window.orinDashboard.charts.throughput.plot.data[1]")
            assert drawn[5] is None  # what uPlot draws: the line breaks there
            assert page.locator("#restarted").is_hidden()

            # another process, up 2 s after the last row: less than a gap, still a break
            fake.started, fake.ts = t0 + 66, [t0 + 67, t0 + 68]
            poll(lambda: len(column(page, "t")) == 10, "the restarted server's rows")
            assert column(page) == [1.0] * 5 + [None, 1.0, None, 1.0, 1.0]
            assert page.locator("#restarted").is_visible()
            assert "server restarted at" in (page.locator("#restarted").text_content() or "")

            # two hours later (a tab asleep): the page keeps the server's window only
            fake.ts = [t0 + 7200 + i for i in range(400)]
            poll(lambda: column(page, "t")[-1] == fake.ts[-1], "rows two hours later")
            held = column(page, "t")
            assert held[0] > fake.ts[-1] - template["history_s"]
            assert len(held) <= template["history_s"] / template["interval_s"]
            assert errors == []
    finally:
        browser.unroute("**/dashboard/data*")


@pytest.mark.parametrize("width", [320, 390])
def test_a_phone_width_window_does_not_scroll_sideways(
    browser: BrowserContext, server: tuple[str, ServerState], width: int
) -> None:
    """Tiles, slots table and charts fit a phone held upright (the slots table
    scrolls inside its panel), the charts drawn no wider than the window."""
    base, _ = server
    with watched_page(browser, base) as (page, errors):
        page.set_viewport_size({"width": width, "height": 740})
        poll(lambda: points(page, "throughput") >= 1, "the first history row")
        poll(lambda: page.locator("#slots-body tr").count() >= 1, "the slots")
        assert page.evaluate("document.documentElement.scrollWidth") <= width
        canvas = page.locator("#chart-throughput canvas").bounding_box()
        assert canvas is not None and canvas["x"] + canvas["width"] <= width
        assert errors == []


def test_the_memory_axis_ticks_at_round_gib(
    browser: BrowserContext, server: tuple[str, ServerState]
) -> None:
    """The memory chart's ticks are whole quarters of a GiB and read as such ("2 GiB"),
    not a byte count's decimal steps ("0.47 GiB, 0.93 GiB")."""
    base, _ = server
    with watched_page(browser, base) as (page, errors):
        poll(lambda: points(page, "memory") >= 1, "the memory chart")
        axis = "window.orinDashboard.charts.memory.plot.axes[1]"
        splits = page.evaluate(f"() => {axis}._splits")
        labels = page.evaluate(f"() => {axis}._values")
        assert splits and all(v % (2**30 / 4) == 0 for v in splits), splits
        assert labels == [f"{v / 2**30:g} GiB" for v in splits]
        assert errors == []


UNNAMED_CONTROLS = """() => [...document.querySelectorAll("input, textarea, select, button")]
    .filter((el) => !(el.labels && el.labels.length) && !el.getAttribute("aria-label")
                    && !(el.tagName === "BUTTON" && el.textContent.trim()))
    .map((el) => el.id || el.outerHTML)"""


def test_every_control_has_a_name_a_screen_reader_reads(
    browser: BrowserContext, server: tuple[str, ServerState]
) -> None:
    """A label (or an aria-label) for every field and a text for every button, so a
    screen reader says more than "edit text"; the connection state is a live status."""
    base, _ = server
    with watched_page(browser, base) as (page, errors):
        poll(lambda: points(page, "throughput") >= 1, "the first history row")
        assert page.evaluate(UNNAMED_CONTROLS) == []
        assert page.locator("#conn").get_attribute("role") == "status"
        assert errors == []


# The WCAG contrast ratio of an element's text against the colour behind it, and
# the luminance of that colour (0 black .. 1 white).
CONTRAST = """(sel) => {
    const rgb = (c) => c.match(/[\\d.]+/g).slice(0, 3).map(Number);
    const lum = ([r, g, b]) => [r, g, b].map((v) => {
        v /= 255;
        return v <= 0.03928 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4;
    }).reduce((a, v, i) => a + v * [0.2126, 0.7152, 0.0722][i], 0);
    const el = document.querySelector(sel);
    let bg = el;
    while (bg && getComputedStyle(bg).backgroundColor === "rgba(0, 0, 0, 0)") bg = bg.parentElement;
    const back = lum(rgb(getComputedStyle(bg || document.body).backgroundColor));
    const text = lum(rgb(getComputedStyle(el).color));
    return [(Math.max(back, text) + 0.05) / (Math.min(back, text) + 0.05), back];
}"""


@pytest.mark.parametrize("scheme", ["light", "dark"])
def test_the_page_follows_the_browsers_colour_scheme_with_readable_text(
    browser: BrowserContext, server: tuple[str, ServerState], scheme: Any
) -> None:
    """A dark-mode browser gets a dark page, charts included (their axes drawn in the
    page's colours); text keeps a contrast of at least 4.5:1 in both."""
    base, _ = server
    with watched_page(browser, base) as (page, errors):
        page.emulate_media(color_scheme=scheme)
        page.reload()
        poll(lambda: points(page, "throughput") >= 1, "the first history row")
        for sel in ("#model", "#meta", ".tile .label", "#tile-slots", "#chart-throughput h3"):
            ratio, back = page.evaluate(CONTRAST, sel)
            assert ratio >= 4.5, (sel, ratio)
            assert (back < 0.2) == (scheme == "dark"), (sel, back)
        axis = page.evaluate("() => window.orinDashboard.charts.throughput.plot.axes[1].stroke()")
        muted = page.evaluate(
            "() => getComputedStyle(document.documentElement).getPropertyValue('--muted').trim()"
        )
        assert axis == muted
        assert errors == []


def _luminance(rgb: tuple[float, ...]) -> float:
    c = [v / 255 for v in rgb]
    c = [v / 12.92 if v <= 0.03928 else ((v + 0.055) / 1.055) ** 2.4 for v in c]
    return 0.2126 * c[0] + 0.7152 * c[1] + 0.0722 * c[2]


def _rgb(css: str) -> tuple[float, ...]:
    """``#12869a`` or ``rgb(26, 31, 39)``."""
    if css.startswith("#"):
        return tuple(int(css[i : i + 2], 16) for i in (1, 3, 5))
    return tuple(float(v) for v in css[css.index("(") + 1 : css.index(")")].split(",")[:3])


@pytest.mark.parametrize("scheme", ["light", "dark"])
def test_every_chart_line_stands_out_from_the_chart_and_says_what_it_plots(
    browser: BrowserContext, server: tuple[str, ServerState], scheme: Any
) -> None:
    """Each series colour, all eight (an Orin has that many thermal zones), keeps at
    least 3:1 against the chart's background (WCAG's rule for graphics) in both
    schemes; each drawing is an image named for a screen reader."""
    base, _ = server
    zones = [f"zone{i}" for i in range(8)]

    def board(route: Any) -> None:
        data = httpx.get(route.request.url).json()
        n = len(data["history"]["t"])
        data["history"]["temp_c"] = {z: [40.0 + i] * n for i, z in enumerate(zones)}
        route.fulfill(json=data)

    with watched_page(browser, base) as (page, errors):
        page.route("**/dashboard/data*", board)
        page.emulate_media(color_scheme=scheme)
        page.reload()
        poll(lambda: points(page, "temp") >= 1, "the temperature chart")
        strokes = page.evaluate(
            "() => window.orinDashboard.charts.temp.plot.series.slice(1).map((s) => s.stroke())"
        )
        assert len(set(strokes)) == len(zones)
        back = _luminance(_rgb(page.evaluate(
            "() => getComputedStyle(document.querySelector('#chart-temp')).backgroundColor"
        )))  # fmt: skip
        assert (back < 0.2) == (scheme == "dark")
        for stroke in strokes:
            line = _luminance(_rgb(stroke))
            ratio = (max(line, back) + 0.05) / (min(line, back) + 0.05)
            assert ratio >= 3, (stroke, round(ratio, 2))
        images = page.evaluate(
            """() => [...document.querySelectorAll(".chart:not([hidden])")].map((c) => {
                const img = c.querySelector("[role=img]");
                const label = img && img.getAttribute("aria-label");
                return [c.id, label, !!(img && img.querySelector("canvas"))];
            })"""
        )
        assert len(images) >= 6
        for chart, label, has_canvas in images:
            assert label and label.startswith("Line chart of ") and has_canvas, chart
        labels = {c: label for c, label, _ in images}
        assert "thermal zone" in labels["chart-temp"] and "per second" in labels["chart-throughput"]
        legend = page.locator("#chart-temp .u-legend")
        assert legend.is_visible() and "zone7" in (legend.text_content() or "")
        page.unroute("**/dashboard/data*")
        assert errors == []


@pytest.fixture(scope="module")
def keyed_server() -> Iterator[tuple[str, ServerState]]:
    old = os.environ.get(KEY_ENV)
    os.environ[KEY_ENV] = "orin-sesame"
    try:
        profile = PROFILE.replace("server: {", f"server: {{api_key_env: {KEY_ENV}, ")
        with live_server(demo.ensure("tiny", "f16"), profile) as s:
            yield s
    finally:
        if old is None:
            os.environ.pop(KEY_ENV, None)
        else:
            os.environ[KEY_ENV] = old


def test_with_a_key_the_login_refuses_a_wrong_key_and_opens_on_the_right_one(
    browser: BrowserContext, keyed_server: tuple[str, ServerState]
) -> None:
    base, state = keyed_server
    browser.clear_cookies()
    with watched_page(browser, base) as (page, _):
        assert page.locator("#login-form").is_visible()
        assert page.locator("#charts").count() == 0
        assert state.model_name not in page.content()

        page.fill("#key", "not-the-key")
        page.click("#login-form button[type=submit]")
        page.wait_for_selector("#login-error")
        assert page.locator("#charts").count() == 0

        page.fill("#key", "orin-sesame")
        page.click("#login-form button[type=submit]")
        page.wait_for_selector("#charts")
        poll(lambda: points(page, "throughput") >= 1, "data fetched with the cookie")
        cookie = next(c for c in browser.cookies() if c["name"] == "orin_llm_key")
        assert cookie.get("httpOnly") and cookie.get("sameSite") == "Strict"
        _chat(page, "Hello with a key")  # the playground's /v1 call carries the cookie
        page.click("#logout button")
        page.wait_for_selector("#login-form")
        assert not [c for c in browser.cookies() if c["name"] == "orin_llm_key"]
    browser.clear_cookies()
