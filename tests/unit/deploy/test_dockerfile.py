"""deploy/Dockerfile, checked statically (NVIDIA's base images cannot be pulled here):
a pinned L4T base, the build script in jetson mode, a non-root user, /health, the
models volume, port 8080, and a build context that holds what it copies."""

from __future__ import annotations

import fnmatch
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from dockerfile_parse import DockerfileParser

from orin.model.store import SYSTEM_MODELS_DIR
from orin.profile.schema import ServerSection
from tests.unit.bench.test_loadgen import Answer, serving

REPO = Path(__file__).resolve().parents[3]
DOCKERFILE = REPO / "deploy" / "Dockerfile"
DOCKERIGNORE = REPO / "deploy" / ".dockerignore"
SCRIPT = "scripts/install-llama-cpp.sh"


@pytest.fixture(scope="module")
def parser() -> DockerfileParser:
    return DockerfileParser(str(DOCKERFILE))


def instructions(parser: DockerfileParser) -> list[dict[str, Any]]:
    return [i for i in parser.structure if i["instruction"] != "COMMENT"]


def stages(parser: DockerfileParser) -> list[list[dict[str, Any]]]:
    out: list[list[dict[str, Any]]] = []
    for i in instructions(parser):
        if i["instruction"] == "FROM":
            out.append([])
        if out:
            out[-1].append(i)
    return out


def final(parser: DockerfileParser, instruction: str) -> list[dict[str, Any]]:
    return [i for i in stages(parser)[-1] if i["instruction"] == instruction]


def test_the_base_is_nvidias_l4t_image_pinned_by_tag(parser: DockerfileParser) -> None:
    images = parser.parent_images  # ARG defaults substituted
    assert len(images) == 2
    for image in images:
        name, _, tag = image.rpartition(":")
        assert name == "nvcr.io/nvidia/l4t-jetpack"
        assert tag.startswith("r36.") and tag.count(".") == 2, image  # JetPack 6, one release
    assert parser.baseimage == images[-1]


def test_no_latest_tags_and_no_downloads_by_add(parser: DockerfileParser) -> None:
    text = DOCKERFILE.read_text(encoding="utf-8")
    assert ":latest" not in text
    for image in parser.parent_images:
        assert ":" in image.rsplit("/", 1)[-1], f"{image}: no tag is latest"
    for i in instructions(parser):
        if i["instruction"] == "ADD":
            assert "://" not in i["value"], i["value"]
        if i["instruction"] == "COPY" and "--from=" in i["value"]:
            source = i["value"].split("--from=")[1].split()[0]
            assert source == "build", "copies come from the build stage, not an image"


def test_llama_cpp_is_built_by_the_install_script_in_jetson_mode(
    parser: DockerfileParser,
) -> None:
    runs = [i["value"] for i in instructions(parser) if i["instruction"] == "RUN"]
    (script_run,) = [r for r in runs if SCRIPT in r]
    assert "--mode jetson" in script_run
    # the script's flags are not repeated here: the script is the one place for them
    text = DOCKERFILE.read_text(encoding="utf-8")
    for flag in ("CMAKE_ARGS", "-DGGML", "CMAKE_CUDA_ARCHITECTURES", "FA_QUANTS"):
        assert flag not in text, flag
    # it happens in the build stage, and the image gets the venv it built
    assert any(SCRIPT in i["value"] for i in stages(parser)[0] if i["instruction"] == "RUN")
    assert not any(SCRIPT in i["value"] for i in stages(parser)[-1])


def test_the_scripts_jetson_mode_builds_for_sm_87() -> None:
    """The options the Dockerfile passes exist, and jetson mode means sm_87 with CUDA."""
    env = {**os.environ, "ORIN_LLM_SYSROOT": "/nonexistent", "ORIN_LLM_RPC": "1"}
    out = subprocess.run(
        ["bash", SCRIPT, "--python", sys.executable, "--mode", "jetson", "--dry-run"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert "mode=jetson" in out
    assert "-DGGML_CUDA=ON" in out and "-DCMAKE_CUDA_ARCHITECTURES=87" in out


def test_the_server_runs_as_a_user_that_is_not_root(parser: DockerfileParser) -> None:
    users = final(parser, "USER")
    assert users, "the final stage sets a USER"
    user = users[-1]["value"].split(":")[0]
    assert user not in ("root", "0")
    assert user.isdigit(), "numeric, so Kubernetes can check runAsNonRoot"
    # the image's processes (ENTRYPOINT, CMD, HEALTHCHECK) come after it
    order = [i["instruction"] for i in stages(parser)[-1]]
    last_user = len(order) - 1 - order[::-1].index("USER")
    assert {"ENTRYPOINT", "CMD", "HEALTHCHECK"} <= set(order[last_user:])


def test_healthcheck_asks_health(parser: DockerfileParser) -> None:
    (check,) = final(parser, "HEALTHCHECK")
    assert "--start-period=" in check["value"]  # loading a model is not unhealthy
    assert healthcheck_argv(parser) == ["python3", "-m", "orin.deploy.healthcheck"]


def healthcheck_argv(parser: DockerfileParser) -> list[str]:
    (check,) = final(parser, "HEALTHCHECK")
    argv: list[str] = json.loads(check["value"].split(" CMD ", 1)[1])
    return argv


def run_healthcheck(parser: DockerfileParser, port: int) -> subprocess.CompletedProcess[str]:
    """The image's HEALTHCHECK command as Docker runs it, with this Python, a proxy in
    the environment that would swallow a request sent through it."""
    argv = [sys.executable, *healthcheck_argv(parser)[1:]]
    env = {**os.environ, "ORIN_LLM_PORT": str(port), "PYTHONPATH": str(REPO),
           "http_proxy": "http://127.0.0.1:9", "HTTP_PROXY": "http://127.0.0.1:9"}  # fmt: skip
    env.pop("no_proxy", None), env.pop("NO_PROXY", None)
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(
    ("status", "body", "code", "line"),
    [
        (200, {"status": "ok", "model": "m"}, 0, "200 ok"),
        (503, {"status": "loading"}, 1, "503 loading"),
        (503, {"status": "failed", "error": "out of memory"}, 1, "503 failed: out of memory"),
        (502, "<html>bad gateway</html>", 1, "502 Bad Gateway"),
    ],
)
def test_healthcheck_says_the_status_in_one_line(
    parser: DockerfileParser, status: int, body: Any, code: int, line: str
) -> None:
    """docker inspect keeps what the check prints: one line, never a traceback."""
    with serving(lambda seen: Answer(status, body)) as url:
        port = int(url.split(":")[-1].split("/")[0])
        done = run_healthcheck(parser, port)
    assert (done.returncode, done.stdout, done.stderr) == (code, line + "\n", "")


def test_healthcheck_of_a_server_that_is_down_says_so_in_one_line(
    parser: DockerfileParser,
) -> None:
    with socket.socket() as held:  # bound, never listening: the connection is refused
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1]
        done = run_healthcheck(parser, port)
    assert done.returncode == 1 and done.stderr == ""
    assert done.stdout == f"http://127.0.0.1:{port}/health: connection refused\n"


@pytest.mark.parametrize(
    ("env", "url"),
    [
        ({}, "http://127.0.0.1:8080/health"),
        ({"ORIN_LLM_HOST": "0.0.0.0", "ORIN_LLM_PORT": "9000"}, "http://127.0.0.1:9000/health"),
        ({"ORIN_LLM_HOST": "::"}, "http://[::1]:8080/health"),
        ({"ORIN_LLM_HOST": "10.1.2.3"}, "http://10.1.2.3:8080/health"),
        ({"ORIN_LLM_HOST": "fd00::5"}, "http://[fd00::5]:8080/health"),
    ],
)
def test_healthcheck_asks_the_address_the_server_binds(env: dict[str, str], url: str) -> None:
    """A container whose server listens on one address was asked on 127.0.0.1,
    where nothing answers: unhealthy for ever."""
    from orin.deploy.healthcheck import health_url

    assert health_url(env) == url


def test_models_volume_and_port(parser: DockerfileParser) -> None:
    volumes = [v for i in final(parser, "VOLUME") for v in json.loads(i["value"])]
    assert SYSTEM_MODELS_DIR in volumes
    (expose,) = final(parser, "EXPOSE")
    assert expose["value"] == str(ServerSection.model_fields["port"].default) == "8080"


def test_it_serves_a_profile_on_every_address_of_the_container(
    parser: DockerfileParser,
) -> None:
    (entry,) = final(parser, "ENTRYPOINT")
    (cmd,) = final(parser, "CMD")
    argv = json.loads(entry["value"]) + json.loads(cmd["value"])
    assert argv[:3] == ["orin-llm", "serve", "--profile"]
    assert argv[argv.index("--host") + 1] == "0.0.0.0"
    env = parser.envs  # the final stage's
    assert env["ORIN_LLM_HOST"] == "0.0.0.0"  # also for `docker run IMAGE serve --profile X`
    # the port the HEALTHCHECK asks (it reads ORIN_LLM_PORT: the tests below run it
    # on another), whatever the profile says
    assert "--port" not in argv and env["ORIN_LLM_PORT"] == "8080"
    assert env["ORIN_LLM_CACHE_DIR"].startswith("/var/cache/")


def copied_before_the_script(parser: DockerfileParser) -> list[str]:
    sources: list[str] = []
    for i in stages(parser)[0]:
        if i["instruction"] == "RUN" and SCRIPT in i["value"]:
            return sources
        if i["instruction"] == "COPY":
            sources += i["value"].split()[:-1]
    raise AssertionError("the build script never runs")


def test_the_smoke_test_needs_only_what_is_copied_before_the_script(
    parser: DockerfileParser,
) -> None:
    """The script's smoke generation runs before the rest of the package is copied (so
    a code change does not rebuild llama.cpp): it must import nothing else."""
    code = (
        "import sys, orin.model.smoke; "
        "print('\\n'.join(m.__file__ for n, m in sys.modules.items() "
        "if n.startswith('orin') and getattr(m, '__file__', None)))"
    )
    files = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    copied = copied_before_the_script(parser)
    for f in files:
        rel = Path(f).resolve().relative_to(REPO).as_posix()
        assert any(rel == c or rel.startswith(c.rstrip("/") + "/") for c in copied), rel


def ignored(path: str, rules: list[str]) -> bool:
    """Docker's .dockerignore semantics, enough for these rules: the last match wins."""
    result = False
    for rule in rules:
        negate = rule.startswith("!")
        pattern = rule[1:] if negate else rule
        pattern = pattern.rstrip("/")
        parts = path.split("/")
        prefixes = ["/".join(parts[: n + 1]) for n in range(len(parts))]
        if any(fnmatch.fnmatch(p, pattern) for p in prefixes) or (
            pattern.startswith("**/") and any(fnmatch.fnmatch(x, pattern[3:]) for x in parts)
        ):
            result = not negate
    return result


def test_the_context_holds_what_the_dockerfile_copies(parser: DockerfileParser) -> None:
    rules = [
        line.strip()
        for line in DOCKERIGNORE.read_text(encoding="utf-8").splitlines()
        if line.strip() and not line.startswith("#")
    ]
    for i in instructions(parser):
        if i["instruction"] == "COPY" and "--from=" not in i["value"]:
            for source in i["value"].split()[:-1]:
                assert (REPO / source).exists(), source
                assert not ignored(source.rstrip("/"), rules), source
    for left_out in (".venv/bin/python", "tests/conftest.py", "orin/__pycache__/x.pyc", "m.gguf"):
        assert ignored(left_out, rules), left_out
