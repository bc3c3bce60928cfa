"""The RPC options without llama.cpp: `serve --rpc` parsing and the check that every
worker answers before anything loads (exit 6 naming it), the profile's engine.rpc,
the exit code table, and the worker's systemd unit."""

from __future__ import annotations

import socket
from collections.abc import Sequence
from pathlib import Path

import pytest
from typer.testing import CliRunner

from orin.cli.app import app
from orin.cli.deps import Deps
from orin.cli.errors import exit_code_for
from orin.engine.rpc import RPC_LOST_EXIT, is_loopback, parse_endpoints, probe
from orin.errors import RpcWorkerError
from orin.install.units import RPC_WORKER_SERVICE, RpcWorkerUnit, render_rpc_worker_unit
from orin.profile.loader import parse_profile
from orin.system.commands import CommandResult
from tests.serverutil import free_port, poll

runner = CliRunner()


def invoke(*args: str, obj: object = None) -> tuple[int, str, str]:
    result = runner.invoke(app, list(args), env={"COLUMNS": "240"}, obj=obj)
    return result.exit_code, result.stdout, result.stderr


def test_endpoints_parse_in_order_and_bad_ones_are_refused() -> None:
    assert parse_endpoints("10.0.0.2:50052, board-b:50053") == ("10.0.0.2:50052", "board-b:50053")
    assert parse_endpoints(["127.0.0.1:1"]) == ("127.0.0.1:1",)
    assert parse_endpoints("") == ()
    for bad in ("10.0.0.2", "host:0", "host:99999", ":50052", "host:port", "[::1]:50052"):
        with pytest.raises(ValueError, match="not HOST:PORT"):
            parse_endpoints(bad)


def test_loopback_addresses() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("127.1.2.3") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.0.0.2")


def test_the_profile_field_is_checked() -> None:
    p = parse_profile("name: p\nengine: {rpc: ['10.0.0.2:50052', 'b:50053']}\n")
    assert p.engine.rpc == ["10.0.0.2:50052", "b:50053"]
    assert parse_profile("name: p\n").engine.rpc == []
    with pytest.raises(Exception, match="not host:port"):
        parse_profile("name: p\nengine: {rpc: ['10.0.0.2']}\n")
    with pytest.raises(Exception, match="listed twice"):
        parse_profile("name: p\nengine: {rpc: ['a:1', 'a:1']}\n")


def test_a_worker_error_exits_6_as_the_lost_worker_exit() -> None:
    assert exit_code_for(RpcWorkerError("x")) == RPC_LOST_EXIT == 6


def test_probe_says_why_a_worker_cannot_be_reached() -> None:
    port = free_port()
    assert probe(f"127.0.0.1:{port}", timeout=2) is not None  # nothing listens
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
        s.listen()
        assert probe(f"127.0.0.1:{port}", timeout=2) is None


def test_a_worker_that_times_out_is_not_only_said_to_be_stopped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from orin.engine import rpc

    answers = {"10.0.0.2:50052": "Connection refused", "10.0.0.3:50052": "timed out"}
    monkeypatch.setattr(rpc, "probe", lambda ep: answers[ep])
    with pytest.raises(RpcWorkerError) as refused:
        rpc.check_workers(["10.0.0.2:50052"])
    assert str(refused.value) == (
        "cannot reach RPC worker 10.0.0.2:50052 (Connection refused); start it with "
        "`orin-llm rpc-worker --host ADDR --port PORT` on that board"
    )
    with pytest.raises(RpcWorkerError) as timed_out:
        rpc.check_workers(["10.0.0.3:50052"])
    message = str(timed_out.value)
    assert message.startswith("cannot reach RPC worker 10.0.0.3:50052 (timed out); ")
    assert "firewall" in message and "serves one server at a time" in message


def test_a_worker_name_that_does_not_resolve_is_not_said_to_be_stopped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A misspelt host name: there is no board to start a worker on, so the line says
    the name does not resolve and what to check (the resolver faked at the socket)."""
    from orin.engine import rpc

    def no_such_name(*args: object, **kwargs: object) -> socket.socket:
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")

    monkeypatch.setattr(rpc.socket, "create_connection", no_such_name)
    assert rpc.probe("board-b:50052") == (
        "the host name does not resolve: Name or service not known"
    )
    with pytest.raises(RpcWorkerError) as unknown:
        rpc.check_workers(["board-b:50052"])
    assert str(unknown.value) == (
        "cannot reach RPC worker board-b:50052 (the host name does not resolve: Name or "
        "service not known); check the name (DNS, /etc/hosts), or give the board's IPv4 "
        "address"
    )


def test_serve_with_an_unreachable_worker_exits_6_naming_it_before_loading(
    tmp_path: Path,
) -> None:
    up = socket.socket()
    up.bind(("127.0.0.1", 0))
    up.listen()
    ok, down = up.getsockname()[1], free_port()
    profile = tmp_path / "p.yaml"
    # a model path that does not exist: the worker check must come first
    profile.write_text(f"name: p\nmodel: {{path: {tmp_path / 'none.gguf'}}}\n")
    try:
        code, _, err = invoke(
            "serve", "--profile", str(profile), "--rpc", f"127.0.0.1:{ok},127.0.0.1:{down}"
        )
    finally:
        up.close()
    assert code == 6, err
    assert f"cannot reach RPC worker 127.0.0.1:{down} (" in err
    assert f"127.0.0.1:{ok}" not in err
    # the same check for workers the profile names
    missing = tmp_path / "none.gguf"
    profile.write_text(
        f"name: p\nmodel: {{path: {missing}}}\nengine: {{rpc: ['127.0.0.1:{down}']}}\n"
    )
    code, _, err = invoke("serve", "--profile", str(profile))
    assert code == 6 and f"127.0.0.1:{down}" in err


def test_a_malformed_rpc_option_is_a_usage_error() -> None:
    code, _, err = invoke("serve", "--rpc", "10.0.0.2")
    assert code == 2 and "not HOST:PORT" in err
    code, _, err = invoke("serve", "--profile", "demo", "--rpc", "127.0.0.1:9,127.0.0.1:9")
    assert code == 2 and "engine.rpc: a worker is listed twice" in err
    assert "Value error" not in err and "ValidationError" not in err
    many = ",".join(f"127.0.0.1:{9000 + i}" for i in range(17))
    code, _, err = invoke("serve", "--profile", "demo", "--rpc", many)
    assert code == 2 and "engine.rpc: List should have at most 16 items" in err


def unit(**changes: object) -> str:
    base = {
        "executable": "/opt/orin-llm/bin/orin-llm",
        "user": "orin-llm",
        "groups": ("video", "render"),
        "host": "10.0.0.2",
        "port": 50052,
        "devices": ("/dev/nvmap",),
    }
    return render_rpc_worker_unit(RpcWorkerUnit(**{**base, **changes}))  # type: ignore[arg-type]


def test_the_worker_unit_binds_to_the_configured_address_hardened_like_serve() -> None:
    text = unit()
    assert "ExecStart=/opt/orin-llm/bin/orin-llm rpc-worker --host 10.0.0.2 --port 50052\n" in text
    for line in ("User=orin-llm", "SupplementaryGroups=video render", "Restart=always",
                 "StartLimitIntervalSec=0", "NoNewPrivileges=yes", "ProtectSystem=strict",
                 "DevicePolicy=closed", "DeviceAllow=/dev/nvmap rw", "ProtectHome=yes",
                 "After=network-online.target orin-llm-tune.service"):  # fmt: skip
        assert line + "\n" in text, line
    assert "no authentication and no encryption" in text
    assert "IPAddressDeny" not in text and "{{" not in text


def test_the_worker_unit_options() -> None:
    text = unit(threads=6, cache=True, allow=("10.0.0.1", "10.0.1.0/24"), port=50060)
    assert "--port 50060 --threads 6 --cache /var/cache/orin-llm/rpc\n" in text
    assert "IPAddressDeny=any\nIPAddressAllow=localhost 10.0.0.1 10.0.1.0/24\n" in text
    assert "Description=orin-llm RPC worker on 10.0.0.2:50060" in text


class _Runner:
    def __init__(self) -> None:
        self.calls: list[tuple[str, ...]] = []

    def run(
        self, argv: Sequence[str], timeout: float = 30.0, input: str | None = None
    ) -> CommandResult:
        args = tuple(argv)
        self.calls.append(args)
        if args[0] == "getent":
            return CommandResult(args, 0 if args[1] == "group" else 2, "", "")
        if args[:2] == ("systemctl", "is-active") or args[:2] == ("systemctl", "is-enabled"):
            return CommandResult(args, 3, "inactive\n", "")
        return CommandResult(args, 0, "", "")

    def which(self, name: str) -> str | None:
        return None


def test_install_rpc_worker_writes_the_unit_and_enables_it(tmp_path: Path) -> None:
    fake = _Runner()
    deps = Deps(runner=fake, effective_uid=lambda: 0, orin_executable=lambda: "/opt/o/orin-llm")  # type: ignore[arg-type]
    args = ("install-rpc-worker", "--host", "10.0.0.2", "--allow", "10.0.0.1")
    code, _, err = invoke(*args, "--root", str(tmp_path), obj=deps)
    # without systemd nothing is done: no user, no unit
    assert code != 0 and "systemd is not running" in err and fake.calls[-1][0] != "useradd"
    assert not (tmp_path / "etc").exists()
    fake.calls.clear()
    (tmp_path / "run/systemd/system").mkdir(parents=True)
    code, out, err = invoke(*args, "--root", str(tmp_path), obj=deps)
    assert code == 0, err
    written = (tmp_path / "etc/systemd/system" / RPC_WORKER_SERVICE).read_text()
    assert "--host 10.0.0.2 --port 50052 --cache /var/cache/orin-llm/rpc" in written
    assert "no authentication and no encryption" in err  # the loud warning
    assert fake.calls[-2:] == [
        ("systemctl", "daemon-reload"),
        ("systemctl", "enable", "--now", RPC_WORKER_SERVICE),
    ]
    assert any(c[0] == "useradd" for c in fake.calls)  # the user did not exist
    # a dry run prints the unit and changes nothing; a non-root run is refused
    code, out, _ = invoke(*args, "--dry-run", "--root", str(tmp_path / "x"), obj=deps)
    assert code == 0 and "IPAddressAllow=localhost 10.0.0.1" in out
    assert not (tmp_path / "x").exists()
    user = Deps(runner=_Runner(), effective_uid=lambda: 1000, orin_executable=lambda: "/o")  # type: ignore[arg-type]
    code, _, err = invoke(*args, "--root", str(tmp_path / "y"), obj=user)
    assert code != 0 and "as root" in err


@pytest.mark.parametrize(
    ("option", "value", "says"),
    [
        ("--allow", "notanip", "not an address or CIDR"),
        ("--allow", "10.0.0.1 0.0.0.0/0", "not an address or CIDR"),
        ("--allow", "0.0.0.0/0", "admits every address"),
        ("--allow", "::/0", "admits every address"),
        ("--allow", "any", "not an address or CIDR"),
        ("--host", "10.0.0.2 --evil", "not an IP address or host name"),
        ("--host", "::1", "::1 is an IPv6 address; llama.cpp's RPC server listens on an IPv4"),
        ("--host", "fe80::2", "fe80::2 is an IPv6 address"),
        ("--user", "root", "runs as a user of its own"),
        ("--user", "bad user", "not a user name"),
        ("--user", "-x", "not a user name"),
    ],
)
def test_install_rpc_worker_refuses_what_would_open_its_fence(
    tmp_path: Path, option: str, value: str, says: str
) -> None:
    deps = Deps(runner=_Runner(), effective_uid=lambda: 0, orin_executable=lambda: "/o")  # type: ignore[arg-type]
    args = {"--host": "10.0.0.2", "--allow": "10.0.0.1", option: value}
    argv = [x for k, v in args.items() for x in (k, v)]
    code, out, err = invoke(
        "install-rpc-worker", *argv, "--dry-run", "--root", str(tmp_path), obj=deps
    )
    assert code == 2 and says in err and out == ""


def test_install_rpc_worker_listens_on_every_interface_only_behind_allow(tmp_path: Path) -> None:
    deps = Deps(runner=_Runner(), effective_uid=lambda: 0, orin_executable=lambda: "/o")  # type: ignore[arg-type]
    argv = ("install-rpc-worker", "--host", "0.0.0.0", "--dry-run", "--root", str(tmp_path))
    code, out, err = invoke(*argv, obj=deps)
    assert code == 2 and out == "" and "0.0.0.0 listens on every interface" in err
    assert "--allow" in err
    code, out, _ = invoke(*argv, "--allow", "10.0.0.1", obj=deps)
    assert code == 0 and "IPAddressDeny=any\nIPAddressAllow=localhost 10.0.0.1\n" in out


def test_a_worker_that_does_not_answer_is_named_while_loading_waits(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A worker busy with another server accepts the connection and answers only
    once that server leaves: the log names it instead of a silent 'loading'."""
    import logging
    import threading

    from orin.engine import rpc

    noticed = threading.Event()

    class Handler(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "RPC worker 10.0.0.3:50052 accepted the connection" in record.getMessage():
                noticed.set()

    def busy_worker(endpoint: bytes) -> int:
        assert endpoint == b"10.0.0.3:50052"
        assert noticed.wait(60), "no notice while the worker kept the server waiting"
        return 42

    monkeypatch.setattr(rpc, "WAIT_NOTICE_S", 0.01)
    handler = Handler(logging.WARNING)
    logging.getLogger("orin.engine").addHandler(handler)
    try:
        assert rpc._connect(busy_worker, "10.0.0.3:50052") == 42
        noticed.clear()
        monkeypatch.setattr(rpc, "WAIT_NOTICE_S", 60.0)
        assert rpc._connect(lambda ep: 7, "10.0.0.3:50052") == 7  # a prompt answer
        assert not noticed.is_set()
    finally:
        logging.getLogger("orin.engine").removeHandler(handler)


def test_rpc_worker_says_why_its_cache_folder_cannot_be_used(tmp_path: Path) -> None:
    """Before llama.cpp's backend is even loaded: a usage error, not a traceback."""
    a_file = tmp_path / "file"
    a_file.write_text("x")
    for cache, says in [
        (a_file, "cannot make the folder: File exists"),
        (a_file / "sub", "cannot make the folder: Not a directory"),
    ]:
        code, _, err = invoke("rpc-worker", "--port", "50052", "--cache", str(cache))
        assert code == 2 and f"{cache}: {says}" in err, err
        assert "internal error" not in err and "Traceback" not in err


def test_rpc_worker_says_why_an_ipv6_host_cannot_be_used() -> None:
    code, _, err = invoke("rpc-worker", "--host", "::1", "--port", "50052")
    assert code == 2 and "::1 is an IPv6 address" in err and "::1:50052" not in err


def test_endpoints_say_what_is_wrong_with_them() -> None:
    for bad, says in [
        ("10.0.0.2", "the port is missing"),
        ("10.0.0.2:99999", "the port 99999 is not in 1-65535"),
        ("10.0.0.2:abc", "the port 'abc' is not a number"),
        (":50052", "the host is missing"),
        ("[::1]:50052", "an IPv6 address cannot name a worker"),
        ("fe80::1", "an IPv6 address cannot name a worker"),
        ("tcp://10.0.0.2:50052", "without a scheme"),
    ]:
        with pytest.raises(ValueError, match="not HOST:PORT") as info:
            parse_endpoints(bad)
        assert says in str(info.value), (bad, str(info.value))
        with pytest.raises(Exception, match="not host:port") as profile_error:
            parse_profile(f"name: p\nengine: {{rpc: ['{bad}']}}\n")
        assert says in str(profile_error.value)
    assert parse_profile("name: p\nengine: {rpc: [' a:1', 'b:2 ']}\n").engine.rpc == ["a:1", "b:2"]
    with pytest.raises(Exception, match="listed twice"):
        parse_profile("name: p\nengine: {rpc: ['a:1', ' a:1']}\n")


def test_the_lost_worker_line_names_the_worker_whose_connection_closed() -> None:
    from orin.engine.rpc import TCP_ESTABLISHED, connection_states, lost_message

    with socket.socket() as a, socket.socket() as b:
        for s in (a, b):
            s.bind(("127.0.0.1", 0))
            s.listen()
        alive, gone = (f"127.0.0.1:{s.getsockname()[1]}" for s in (a, b))
        # this process's connections to both workers, as the RPC client holds them
        to_a = socket.create_connection(("127.0.0.1", a.getsockname()[1]))
        to_b = socket.create_connection(("127.0.0.1", b.getsockname()[1]))
        peer_a, _ = a.accept()
        peer_b, _ = b.accept()
        try:
            assert TCP_ESTABLISHED in connection_states([alive, gone])[gone]
            peer_b.close()  # worker B goes away: its end closes, and its port too
            b.close()
            states = connection_states([alive, gone])
            assert TCP_ESTABLISHED in states[alive] and TCP_ESTABLISHED not in states[gone]
            text = lost_message("Remote RPC server crashed", [alive, gone])
            assert text.startswith(f"lost RPC worker {gone} (llama.cpp: Remote RPC server crashed)")
            assert alive not in text and f"exiting with code {RPC_LOST_EXIT}" in text
            # every connection is up and every worker answers: an abort of another
            # cause is not blamed on a worker
            other = lost_message("GGML_ASSERT(x) failed", [alive])
            assert other.startswith("llama.cpp aborted: GGML_ASSERT(x) failed")
        finally:
            for s in (to_a, to_b, peer_a):
                s.close()


def test_an_abort_while_connecting_to_a_worker_is_a_failed_handshake(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """What answers at a worker's address but fails llama.cpp's handshake (another
    program on the port, a worker of another RPC protocol version) is not a lost
    worker, and a restart does not mend it: the line says what to check."""
    from orin.engine import rpc

    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        endpoint = f"127.0.0.1:{other.getsockname()[1]}"
        monkeypatch.setattr(rpc, "_endpoints", (endpoint,))
        monkeypatch.setattr(rpc, "_waiting_for", endpoint)  # inside add_server
        text = rpc.abort_message("ggml-rpc.cpp:123: RPC handshake failed")
        assert text.startswith(f"RPC worker {endpoint} failed llama.cpp's RPC handshake")
        assert "RPC server version mismatch" in text and "same orin-llm and llama-cpp" in text
        assert "lost" not in text and f"exiting with code {RPC_LOST_EXIT}" in text
        monkeypatch.setattr(rpc, "_waiting_for", None)  # the model loaded: a lost worker
        assert "handshake" not in rpc.abort_message("Remote RPC server crashed")
    # a worker that went away during the handshake is lost, not the wrong program
    monkeypatch.setattr(rpc, "_waiting_for", endpoint)
    assert rpc.abort_message("Remote RPC server crashed").startswith(f"lost RPC worker {endpoint}")


def test_a_thread_waiting_on_a_worker_that_moves_nothing_is_found_stalled(
    tmp_path: Path,
) -> None:
    """The stop's stall watch: a thread in a system call on a worker's socket (a fake
    /proc/self/task tree, the real socket) with not one byte acknowledged or received
    for quiet_s. Bytes that move start the wait over; a socket to anything that is no
    worker, or a thread outside a system call, is no stall."""
    from orin.engine.rpc import StallWatch, socket_traffic

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        endpoint = f"127.0.0.1:{listener.getsockname()[1]}"
        conn = socket.create_connection(listener.getsockname())
        peer, _ = listener.accept()
        try:
            task = tmp_path / "self/task/4242"
            task.mkdir(parents=True)
            (tmp_path / "self/fd").mkdir()
            (tmp_path / f"self/fd/{conn.fileno()}").symlink_to("socket:[77]")
            now = [0.0]
            watch = StallWatch([endpoint], quiet_s=10.0, root=tmp_path, clock=lambda: now[0])
            other = StallWatch(["127.0.0.1:1"], quiet_s=10.0, root=tmp_path, clock=lambda: now[0])
            (task / "syscall").write_text("running\n")
            assert watch.check() is None
            (task / "syscall").write_text("-1 0x7ffc1d0 0x7f01a2b\n")  # blocked, no call
            assert watch.check() is None
            # recvfrom(fd, ...): llama.cpp waits for the worker's answer
            recvfrom = f"45 {conn.fileno():#x} 0x7f0 0x8 0x0 0x0 0x0 0x7f 0x7f\n"
            (task / "syscall").write_text(recvfrom)
            assert watch.check() is None and other.check() is None
            now[0] = 9.0
            assert watch.check() is None
            before = socket_traffic(conn.fileno())
            peer.sendall(b"answer")  # the worker answers: the wait starts over
            poll(lambda: socket_traffic(conn.fileno()) != before, "the answer received")
            now[0] = 12.0
            assert watch.check() is None
            now[0] = 21.0
            assert watch.check() is None
            now[0] = 22.0
            assert watch.check() == endpoint
            assert other.check() is None  # a socket to no worker of its own
        finally:
            conn.close()
            peer.close()
