"""The listening socket, bound before the model loads: why a bind fails, in words."""

from __future__ import annotations

import errno
import socket

import pytest

from orin.errors import BindError
from orin.server.main import _bind_message, bind_socket


def test_the_socket_is_bound_and_listening() -> None:
    sock = bind_socket("127.0.0.1", 0)
    try:
        port = sock.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass  # the kernel accepts into the backlog: it listens
    finally:
        sock.close()


def test_a_port_another_socket_listens_on_is_in_use() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(BindError, match=rf"^127\.0\.0\.1:{port} is already in use"):
            bind_socket("127.0.0.1", port)


def test_an_address_of_no_interface_here_is_named() -> None:
    # TEST-NET-1 (RFC 5737): documentation only, never a host's own address
    with pytest.raises(BindError, match=r"^cannot bind 192\.0\.2\.1:\d+: not an address of this"):
        bind_socket("192.0.2.1", 8080)


def test_ipv6_addresses_are_written_in_brackets() -> None:
    with pytest.raises(BindError, match=r"^cannot bind \[2001:db8::1\]:8080: "):
        bind_socket("2001:db8::1", 8080)  # the IPv6 documentation prefix (RFC 3849)


@pytest.mark.parametrize(
    ("exc", "words"),
    [
        (OSError(errno.EACCES, "Permission denied"), "permission denied (a port below 1024"),
        (socket.gaierror(-2, "Name or service not known"), "not an address or a known host"),
        (OSError(errno.EINVAL, "Invalid argument"), "Invalid argument"),
    ],
)
def test_other_failures_say_why(exc: OSError, words: str) -> None:
    message = _bind_message("h:80", 80, exc)
    assert message.startswith("cannot bind h:80: ") and words in message
