"""The container's HEALTHCHECK: ``GET /health`` on the container's port, one line, exit 0 or 1.

Docker keeps what a check prints in ``docker inspect`` (``State.Health.Log``):
one line with the status and why (``503 loading``, ``connection refused``),
never a traceback. Exit 0 is healthy and 1 unhealthy (Docker reserves 2).
Only the standard library: the check costs a Python start every 30 s and
nothing more. No proxy: the server is in this container, whatever
``HTTP_PROXY`` the container was given. It asks the address the server binds
(``ORIN_LLM_HOST``), or loopback where that is every address (``0.0.0.0``, ``::``).

    python3 -m orin.deploy.healthcheck
"""

from __future__ import annotations

import http.client
import json
import os
import sys
import urllib.error
import urllib.request
from http import HTTPStatus

TIMEOUT_S = 4.0  # within the HEALTHCHECK's --timeout=5s
MAX_BODY = 64 * 1024


def summary(status: int, body: bytes) -> str:
    """``200 ok``, ``503 loading``, ``503 failed: <error>``; a body that is not the
    server's JSON gives the status's phrase."""
    try:
        data = json.loads(body)
        state = str(data["status"])
    except (ValueError, KeyError, TypeError):
        try:
            return f"{status} {HTTPStatus(status).phrase}"
        except ValueError:
            return str(status)
    error = data.get("error")
    return f"{status} {state}: {error}" if error else f"{status} {state}"


def check(url: str, timeout: float = TIMEOUT_S) -> tuple[int, str]:
    """(exit code, the line to print) for one ``GET url``."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=timeout) as response:
            status, body = response.status, response.read(MAX_BODY)
    except urllib.error.HTTPError as exc:  # 503 while loading or draining
        status, body = exc.code, exc.read(MAX_BODY)
    except (OSError, ValueError, http.client.HTTPException) as exc:  # refused, timed out, no HTTP
        reason = getattr(exc, "reason", exc)
        text = getattr(reason, "strerror", None) or str(reason) or type(reason).__name__
        return 1, f"{url}: {text.lower()}"
    return (0 if status == 200 else 1), summary(status, body)


def health_url(env: dict[str, str] | os._Environ[str]) -> str:
    """The server's /health as ``serve`` binds it from the container's environment."""
    host = env.get("ORIN_LLM_HOST", "").strip() or "127.0.0.1"
    if host in ("0.0.0.0", "::", "[::]"):  # every address: loopback is one of them
        host = "127.0.0.1" if host == "0.0.0.0" else "::1"
    host = host.strip("[]")
    if ":" in host:  # an IPv6 address goes in brackets in a URL
        host = f"[{host}]"
    return f"http://{host}:{env.get('ORIN_LLM_PORT', '8080')}/health"


def main() -> int:
    code, line = check(health_url(os.environ))
    print(line)
    return code


if __name__ == "__main__":
    sys.exit(main())
