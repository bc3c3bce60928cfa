"""A Hugging Face Hub stand-in on loopback: the endpoints huggingface_hub's model_info,
get_hf_file_metadata and http_get call, with switches for the failures pulls must handle.

- ``GET /api/models/{repo}[/revision/{rev}]`` (``?blobs=True``): id, sha and siblings with
  size and LFS size/sha256; a revision other than main or COMMIT is RevisionNotFound;
- ``HEAD|GET /{repo}/resolve/{rev}/{path}``: ETag, X-Linked-Etag (the LFS sha256),
  X-Linked-Size, X-Repo-Commit; GET honours ``Range: bytes=N-`` with 206.

``cut_after`` makes the first GET of a file send that many bytes of a full-length
response and close the connection; from then on every GET answers 503 until the test
sets ``down`` back to False (the next pull then resumes). ``sha_override`` makes the
metadata announce another SHA-256 than the bytes have. ``refuse`` answers a repository's
file requests with a status (401 without a valid token, 403 for an account without
access). ``size_override`` makes a file's metadata request (HEAD) announce another
size than the file list's; ``short_body`` makes each GET send only that many bytes, with
a Content-Length that says so (a proxy that cuts files); ``portal`` answers the API with
an HTML page; ``loop`` redirects each file request to itself. Every request is recorded.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@dataclass
class Request:
    method: str
    path: str
    range: str | None


@dataclass
class FakeHub:
    repos: dict[str, dict[str, bytes]] = field(default_factory=dict)
    sha_override: dict[str, str] = field(default_factory=dict)  # "repo/path" -> sha256
    no_lfs: set[str] = field(default_factory=set)  # "repo/path" served without LFS info
    cut_after: int | None = None
    gone: set[str] = field(default_factory=set)  # "repo/path" listed, but 404 on download
    no_range: bool = False  # answer a Range request with the whole file (200), as some servers do
    refuse: dict[str, int] = field(default_factory=dict)  # repo -> status of its file requests
    size_override: dict[str, int] = field(default_factory=dict)  # "repo/path" -> HEAD's size
    short_body: int | None = None
    portal: bool = False  # every API request answered with an HTML page (a captive portal)
    loop: bool = False  # every file request redirected to itself
    down: bool = False
    requests: list[Request] = field(default_factory=list)
    on_request: Callable[[Request], None] | None = None  # e.g. what else has happened by now
    url: str = ""

    def sha256(self, repo: str, path: str) -> str:
        return self.sha_override.get(
            f"{repo}/{path}", hashlib.sha256(self.repos[repo][path]).hexdigest()
        )

    def gets(self) -> list[Request]:
        return [r for r in self.requests if r.method == "GET" and "/resolve/" in r.path]

    def info(self, repo: str) -> dict[str, object]:
        siblings = []
        for path, data in self.repos[repo].items():
            sibling: dict[str, object] = {"rfilename": path, "size": len(data), "blobId": "0" * 40}
            if f"{repo}/{path}" not in self.no_lfs:
                sibling["lfs"] = {
                    "size": len(data),
                    "sha256": self.sha256(repo, path),
                    "pointerSize": 134,
                }
            siblings.append(sibling)
        return {"id": repo, "modelId": repo, "sha": COMMIT, "private": False, "siblings": siblings}


_API = re.compile(r"^/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?$")
_RESOLVE = re.compile(r"^/([^/]+/[^/]+)/resolve/([^/]+)/(.+)$")


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: object) -> None:
            pass

        def do_HEAD(self) -> None:
            self._serve(body=False)

        def do_GET(self) -> None:
            self._serve(body=True)

        def _send(self, status: int, headers: dict[str, str], payload: bytes = b"") -> None:
            self.send_response(status)
            for k, v in headers.items():
                self.send_header(k, v)
            self.end_headers()
            if payload:
                self.wfile.write(payload)

        def _json(self, status: int, data: object) -> None:
            payload = json.dumps(data).encode()
            self._send(
                status,
                {"Content-Type": "application/json", "Content-Length": str(len(payload))},
                payload,
            )

        def _serve(self, body: bool) -> None:
            path = unquote(urlparse(self.path).path)
            request = Request(self.command, path, self.headers.get("Range"))
            hub.requests.append(request)
            if hub.on_request is not None:
                hub.on_request(request)
            api = _API.match(path)
            if api and body and hub.portal:
                page = b"<html><body>Log in to use this network</body></html>"
                self._send(
                    200, {"Content-Type": "text/html", "Content-Length": str(len(page))}, page
                )
                return
            if api and body:
                repo = api.group(1)
                if repo not in hub.repos:
                    self._send(
                        404,
                        {"X-Error-Code": "RepoNotFound", "Content-Length": "0"},
                    )
                    return
                if api.group(2) not in (None, "main", COMMIT):
                    self._send(
                        404,
                        {"X-Error-Code": "RevisionNotFound", "Content-Length": "0"},
                    )
                    return
                self._json(200, hub.info(repo))
                return
            resolve = _RESOLVE.match(path)
            if resolve is None:
                self._send(404, {"Content-Length": "0"})
                return
            repo, _, file = resolve.groups()
            if hub.loop:
                self._send(302, {"Location": self.path, "Content-Length": "0"})
                return
            if repo in hub.refuse:
                self._send(hub.refuse[repo], {"Content-Length": "0"})
                return
            data = hub.repos.get(repo, {}).get(file)
            if f"{repo}/{file}" in hub.gone:
                self._send(404, {"Content-Length": "0"})  # a mirror without the file
                return
            if data is None:
                self._send(
                    404,
                    {
                        "X-Error-Code": "EntryNotFound",
                        "X-Repo-Commit": COMMIT,
                        "Content-Length": "0",
                    },
                )
                return
            sha = hub.sha256(repo, file)
            headers = {
                "ETag": f'"{sha}"',
                "X-Linked-Etag": f'"{sha}"',
                "X-Linked-Size": str(hub.size_override.get(f"{repo}/{file}", len(data))),
                "X-Repo-Commit": COMMIT,
                "Accept-Ranges": "bytes",
                "Content-Type": "application/octet-stream",
            }
            if not body:
                self._send(200, {**headers, "Content-Length": str(len(data))})
                return
            if hub.down:
                self._send(503, {"Content-Length": "0"})
                return
            start = 0
            wanted = None if hub.no_range else self.headers.get("Range")
            if wanted:
                m = re.fullmatch(r"bytes=(\d+)-", wanted)
                assert m, wanted
                start = int(m.group(1))
            status = 206 if wanted else 200
            if wanted:
                headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
            rest = data[start:]
            if hub.short_body is not None:
                rest = rest[: hub.short_body]
            headers["Content-Length"] = str(len(rest))
            if hub.cut_after is not None:
                cut, hub.cut_after, hub.down = hub.cut_after, None, True
                self._send(status, headers, rest[:cut])
                self.wfile.flush()
                self.close_connection = True
                return
            self._send(status, headers, rest)

    return Handler


@contextmanager
def serve(hub: FakeHub) -> Iterator[FakeHub]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(hub))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    hub.url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        yield hub
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def point_at(hub: FakeHub, monkeypatch: pytest.MonkeyPatch, home: Path) -> None:
    """Send every hub request of this test to ``hub``: HF_ENDPOINT for orin (read at each
    call), and huggingface_hub's import-time defaults too, so that nothing the library
    does on its own (its user-agent registry fetch) leaves loopback. No token."""
    import huggingface_hub.constants as hf_constants

    monkeypatch.setenv("HF_ENDPOINT", hub.url)
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(hf_constants, "ENDPOINT", hub.url)
    template = hub.url + "/{repo_id}/resolve/{revision}/{filename}"
    monkeypatch.setattr(hf_constants, "HUGGINGFACE_CO_URL_TEMPLATE", template)
    monkeypatch.setattr(hf_constants, "HF_HUB_DISABLE_TELEMETRY", True)
