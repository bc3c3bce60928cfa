"""orin-llm deploy k8s: YAML on stdout or files in a folder, notes apart from the YAML,
and the exit codes of the CLI's conventions."""

from __future__ import annotations

from pathlib import Path

import pytest
import typer.main
import yaml
from typer.testing import CliRunner

from orin.cli.app import app
from orin.profile.loader import load_profile
from tests.unit.deploy.conftest import model_info

runner = CliRunner()


@pytest.fixture
def model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("ORIN_LLM_CACHE_DIR", str(tmp_path / "cache"))
    model_info(tmp_path, "Q4_K_M")
    return tmp_path / "model-Q4_K_M.gguf"


def invoke(*args: str) -> tuple[int, str, str]:
    result = runner.invoke(app, ["deploy", "k8s", *args])
    return result.exit_code, result.stdout, result.stderr


def test_yaml_on_stdout_and_notes_on_stderr(model: Path) -> None:
    code, out, err = invoke("--profile", "llama3.1-8b-q4_k_m", "--model", str(model))
    assert code == 0, err
    objects = list(yaml.safe_load_all(out))
    assert [o["kind"] for o in objects] == [
        "Namespace",
        "ConfigMap",
        "Deployment",
        "Service",
        "PodMonitor",
    ]
    assert "memory plan" in err and "create secret generic" in err
    assert all(line.startswith("# ") for line in err.splitlines())


def test_files_in_a_folder(model: Path, tmp_path: Path) -> None:
    out_dir = tmp_path / "manifests"
    code, out, err = invoke(
        "--profile", "llama2-13b-q4_k_m", "--model", str(model), "--output", str(out_dir),
        "--replicas", "3", "--namespace", "fleet", "--image", "registry.local/orin-llm:0.1.0",
        "--volume", "pvc", "--storage-class", "local-path", "--monitor", "servicemonitor",
        "--monitor-label", "release=kps", "--gpu-group", "44", "--gpu-group", "993",
        "--node-selector", "fleet=lab",
    )  # fmt: skip
    assert code == 0, err
    files = sorted(out_dir.iterdir())
    assert [f.name for f in files] == [
        "01-namespace.yaml",
        "02-configmap.yaml",
        "03-persistentvolumeclaim.yaml",
        "04-deployment.yaml",
        "05-service.yaml",
        "06-servicemonitor.yaml",
    ]
    assert out == ""  # the files' names and the notes are diagnostics: stderr
    assert all(f"wrote {f}" in err.splitlines() for f in files)
    assert "memory plan" in err
    deployment = yaml.safe_load(files[3].read_text())
    assert deployment["metadata"]["namespace"] == "fleet"
    assert deployment["spec"]["replicas"] == 3
    pod = deployment["spec"]["template"]["spec"]
    assert pod["containers"][0]["image"] == "registry.local/orin-llm:0.1.0"
    assert pod["securityContext"]["supplementalGroups"] == [44, 993]
    assert pod["nodeSelector"] == {"fleet": "lab"}
    monitor = yaml.safe_load(files[5].read_text())
    assert monitor["metadata"]["labels"]["release"] == "kps"


def test_a_daemonset(model: Path) -> None:
    code, out, err = invoke("--profile", "demo", "--model", str(model), "--kind", "daemonset")
    assert code == 0, err
    kinds = [o["kind"] for o in yaml.safe_load_all(out)]
    assert "DaemonSet" in kinds and "Deployment" not in kinds


def test_the_default_profile_is_the_demo(model: Path) -> None:
    code, out, err = invoke("--model", str(model))
    assert code == 0, err
    config = next(o for o in yaml.safe_load_all(out) if o["kind"] == "ConfigMap")
    assert "name: demo" in config["data"]["profile.yaml"]


def test_a_model_that_is_not_here_is_exit_3(model: Path) -> None:
    assert load_profile("llama3.1-8b-q4_k_m").model.path is not None
    code, out, err = invoke("--profile", "llama3.1-8b-q4_k_m")
    assert code == 3 and out == ""
    assert "--model PATH" in err


def test_a_projector_that_is_not_here_is_exit_3_and_mmproj_gives_a_copy(
    model: Path, tmp_path: Path
) -> None:
    from orin.model import mmproj

    source = tmp_path / "vision.yaml"
    source.write_text(
        f"name: vision\nmodel: {{path: {model}, mmproj: /home/me/mmproj.gguf}}\n",
        encoding="utf-8",
    )
    code, out, err = invoke("--profile", str(source))
    assert code == 3 and out == "" and "--mmproj PATH" in err
    copy = mmproj.generate("tiny", tmp_path / "copy.gguf")
    code, out, err = invoke("--profile", str(source), "--mmproj", str(copy))
    assert code == 0, err
    # a profile without a projector: the option would be ignored
    code, _, err = invoke("--profile", "demo", "--model", str(model), "--mmproj", str(copy))
    assert code == 2 and "names no model.mmproj" in err


def test_a_draft_model_that_is_not_here_is_exit_3_and_draft_model_gives_a_copy(
    model: Path, tmp_path: Path
) -> None:
    source = tmp_path / "drafting.yaml"
    source.write_text(
        f"name: drafting\nmodel: {{path: {model}}}\n"
        "speculative: {mode: draft, draft_model: /home/me/draft.gguf}\n",
        encoding="utf-8",
    )
    code, out, err = invoke("--profile", str(source))
    assert code == 3 and out == "" and "--draft-model PATH" in err
    code, out, err = invoke("--profile", str(source), "--draft-model", str(model))
    assert code == 0, err
    # a profile without a draft model: the option would be ignored
    code, _, err = invoke("--profile", "demo", "--model", str(model), "--draft-model", str(model))
    assert code == 2 and "speculative.mode: draft" in err


@pytest.mark.parametrize(
    "args",
    [
        ["--kind", "statefulset"],
        ["--volume", "nfs"],
        ["--monitor", "grafana"],
        ["--name", "Bad_Name"],
        ["--namespace", "Fleet"],
        ["--node-selector", "novalue"],
        ["--monitor-label", "k=bad value"],
        ["--replicas", "0"],
        ["--api-key-secret", "-x"],
        ["--image", ""],
        ["--image", "registry.lan/orin-llm 0.1.0"],
        ["--volume", "pvc", "--pvc-size", "lots"],
        ["--volume", "pvc", "--pvc-size", "0Gi"],
        ["--volume", "pvc", "--storage-class", "Local_Path"],
        ["--host-path", "models"],
        ["--host-path", "/var/lib/../models"],
    ],
)
def test_bad_options_are_usage_errors(model: Path, args: list[str]) -> None:
    code, _, err = invoke("--profile", "demo", "--model", str(model), *args)
    assert code == 2, err


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--pvc-size", "20Gi"], "--pvc-size: for --volume pvc"),
        (["--storage-class", "local-path"], "--storage-class: for --volume pvc"),
        (["--volume", "pvc", "--host-path", "/data"], "--host-path is for --volume hostpath"),
        (["--monitor", "none", "--monitor-label", "release=kps"], "--monitor none renders none"),
    ],
)
def test_an_option_for_another_choice_is_a_usage_error(
    model: Path, args: list[str], says: str
) -> None:
    """An option the chosen volume or monitor would ignore is refused, not dropped."""
    code, out, err = invoke("--profile", "demo", "--model", str(model), *args)
    assert code == 2 and says in err and out == ""


def test_the_claims_options_render_a_valid_claim(model: Path) -> None:
    args = ("--volume", "pvc", "--pvc-size", "1.5Gi", "--storage-class", "local-path")
    code, out, err = invoke("--profile", "demo", "--model", str(model), *args)
    assert code == 0, err
    claim = next(o for o in yaml.safe_load_all(out) if o["kind"] == "PersistentVolumeClaim")
    assert claim["spec"]["resources"]["requests"]["storage"] == "1.5Gi"
    assert claim["spec"]["storageClassName"] == "local-path"


def test_an_output_folder_is_made_but_not_under_a_file(model: Path, tmp_path: Path) -> None:
    nested = tmp_path / "a" / "b"
    code, _, err = invoke("--model", str(model), "--output", str(nested))
    assert code == 0, err
    assert (nested / "01-namespace.yaml").is_file()
    (tmp_path / "file").write_text("x")
    code, out, err = invoke("--model", str(model), "--output", str(tmp_path / "file" / "sub"))
    assert code == 2 and "--output" in err and out == ""


def test_deploy_alone_prints_its_help() -> None:
    result = runner.invoke(app, ["deploy"])
    assert "k8s" in result.stdout + result.stderr


def test_the_docs_describe_every_option() -> None:
    """docs/fleet.md's Kubernetes section names each option of deploy k8s."""
    text = (Path(__file__).resolve().parents[3] / "docs" / "fleet.md").read_text()
    section = text.split("## A fleet on Kubernetes", 1)[1].split("\n## ", 1)[0]
    command = typer.main.get_command(app).commands["deploy"].commands["k8s"]  # type: ignore[attr-defined]
    for param in command.params:
        for opt in param.opts:
            if opt.startswith("--"):
                assert f"`{opt}" in section, opt
