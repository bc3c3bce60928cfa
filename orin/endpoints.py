"""A llama.cpp RPC worker's address, ``HOST:PORT``: checked where a profile or a
command line names one (orin.profile, the CLI) and where the engine connects
(orin.engine.rpc), with the same words."""

from __future__ import annotations


def endpoint_problem(text: str) -> str | None:
    """Why ``text`` is not a worker's ``HOST:PORT`` (None when it is one), in words
    that say what to write instead."""
    t = text.strip()
    if "://" in t:
        return "a worker is HOST:PORT, without a scheme"
    if t.startswith("[") or t.count(":") > 1:
        return (
            "an IPv6 address cannot name a worker (llama.cpp splits HOST:PORT at its "
            "first colon): use an IPv4 address or a host name"
        )
    host, sep, port = t.partition(":")
    if not sep or not port:
        return "the port is missing"
    if not host:
        return "the host is missing"
    if not port.isdigit():
        return f"the port {port!r} is not a number"
    if not 0 < int(port) < 65536:
        return f"the port {port} is not in 1-65535"
    return None
