"""pytest hooks for llama.cpp's server tests in benchmarks/peer_tests.py's run.

Stops every server after each test, leaves the slow tests out (their models come
from Hugging Face), records the requests the `openai` client sends (the shim records its
own), and writes one JSON line per test to ORIN_PEER_RESULTS: the outcome, the failed
assertion, the requests with both ends' view of them, and what the servers were started
with.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import utils  # type: ignore[import-not-found]


def _recording(module: Any) -> None:
    """Wraps ``module.Client.send`` (httpx or its fork) to record each request, its
    status and its body (a streamed body as it is read)."""
    send = module.Client.send

    class Tee(module.SyncByteStream):
        def __init__(self, inner: Any, event: dict[str, Any]) -> None:
            self.inner = inner
            self.event = event
            self.seen = bytearray()

        def __iter__(self) -> Iterator[bytes]:
            for chunk in self.inner:
                self.seen += chunk
                self.event["response"] = utils.clip(self.seen.decode(errors="replace"))
                yield chunk

        def close(self) -> None:
            self.inner.close()

    def recording_send(client: Any, request: Any, **kwargs: Any) -> Any:
        try:
            body: Any = json.loads(request.content) if request.content else None
        except ValueError:
            body = request.content.decode(errors="replace")
        path = request.url.path
        event = utils.record(request.method, path, path, body, via="openai")
        try:
            response = send(client, request, **kwargs)
        except Exception as exc:
            event["exception"] = type(exc).__name__
            raise
        event["status"] = response.status_code
        if not kwargs.get("stream"):
            event["response"] = utils.clip(response.text)
        else:
            event["response"] = ""
            response.stream = Tee(response.stream, event)
        return response

    module.Client.send = recording_send


# the openai client sends through httpx, or through its fork httpx2 in newer releases
for _name in ("httpx", "httpx2"):
    try:
        _recording(importlib.import_module(_name))
    except (ImportError, AttributeError):
        continue


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Leaves the slow tests out, as llama.cpp's tests.sh does; their ids go to
    ORIN_PEER_SLOW."""
    if utils.is_slow_test_allowed():
        return
    slow = [item for item in items if "slow" in item.keywords]
    items[:] = [item for item in items if "slow" not in item.keywords]
    config.hook.pytest_deselected(items=slow)
    out = os.environ.get("ORIN_PEER_SLOW")
    if out:
        with open(out, "w") as f:
            json.dump([item.nodeid.removeprefix("unit/") for item in slow], f)


@pytest.fixture(autouse=True)
def stop_servers_after_each_test() -> Iterator[None]:
    yield
    for server in list(utils.server_instances):
        server.stop()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    utils.reset()


def _failure(report: pytest.TestReport) -> dict[str, str]:
    """The first line of the error, and the test's source line that raised it."""
    longrepr = report.longrepr
    crash = getattr(longrepr, "reprcrash", None)
    message = crash.message if crash is not None else str(longrepr)
    line = ""
    entries = getattr(getattr(longrepr, "reprtraceback", None), "reprentries", [])
    for entry in reversed(entries):
        where = getattr(entry, "reprfileloc", None)
        if where is None or not os.path.basename(where.path).startswith("test_"):
            continue
        marked = [x for x in getattr(entry, "lines", []) if x.startswith(">")]
        if marked:
            line = " ".join(marked[-1][1:].split())
            break
    return {
        "message": (message.strip().splitlines() or [""])[0],
        "line": line,
        "detail": utils.clip(str(longrepr), 3000),
    }


_records: dict[str, dict[str, Any]] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    rec = _records.setdefault(
        report.nodeid, {"id": report.nodeid.removeprefix("unit/"), "outcome": "passed"}
    )
    if report.when in ("setup", "call"):
        if report.failed:
            rec["outcome"] = "error" if report.when == "setup" else "failed"
            rec.update(_failure(report))
        elif report.skipped:
            rec["outcome"] = "skipped"
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else ""
            rec["message"] = str(reason).removeprefix("Skipped: ")
        return
    if report.failed and rec["outcome"] == "passed":
        rec["outcome"] = "error"
        rec.update(_failure(report))
    rec["events"] = list(utils.EVENTS)
    rec["starts"] = list(utils.STARTS)
    rec["unsupported"] = {k: v for s in utils.STARTS for k, v in s.get("unsupported", {}).items()}
    if utils.NOT_OFFERED:
        rec["not_offered"] = utils.NOT_OFFERED[0]
    out = os.environ.get("ORIN_PEER_RESULTS")
    if out:
        with open(out, "a") as f:
            f.write(json.dumps(rec, ensure_ascii=False, default=str) + "\n")
    print(
        f"[{utils.server_kind()}] {len(_records)} {rec['id'][:110]}: {rec['outcome']}",
        file=sys.__stderr__,
        flush=True,
    )
