"""deploy k8s's manifests: valid Kubernetes objects for every built-in profile, with the
memory plan's limits, probes that wait for the model, the drain's grace period, no
root anywhere, and the API key from a Secret."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from orin.deploy import k8s
from orin.engine.client import EngineStatus
from orin.errors import ProfileError
from orin.install.units import LOAD_FLOOR_S, MAX_OVER_HIGH, PROCESS_OVERHEAD, STOP_MARGIN_S
from orin.model.store import SYSTEM_MODELS_DIR
from orin.profile.loader import load_profile, parse_profile
from orin.profile.schema import Profile
from orin.server.state import ServerState
from tests.unit.deploy.conftest import BUILTIN, model_info, render

K8S_VERSION = "1.30.0"
MiB = 1 << 20
GiB = 1 << 30
HF = "bartowski/Llama-3.2-1B-Instruct-GGUF:Q4_K_M"

# kubernetes-validate knows the built-in kinds only. The monitors are checked against
# the fields of prometheus-operator's CRDs (monitoring.coreos.com/v1, operator 0.91)
# that the renderer writes: the required ones (spec; spec.selector; a credential's
# key), their types and the duration syntax, and no field the CRD does not have at
# the levels written here.
_DURATION = (
    r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?"
    r"(([0-9]+)ms)?)$"
)
_STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
_ENDPOINT = {
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "port": {"type": "string"},
        "path": {"type": "string"},
        "interval": {"type": "string", "pattern": _DURATION},
        "scrapeTimeout": {"type": "string", "pattern": _DURATION},
        "authorization": {
            "type": "object",
            "additionalProperties": False,
            "properties": {
                "type": {"type": "string"},
                "credentials": {
                    "type": "object",
                    "additionalProperties": False,
                    "required": ["key"],
                    "properties": {
                        "name": {"type": "string"},
                        "key": {"type": "string"},
                        "optional": {"type": "boolean"},
                    },
                },
            },
        },
    },
}


def _monitor_schema(kind: str, endpoints: str) -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "additionalProperties": False,
        "properties": {
            "apiVersion": {"const": "monitoring.coreos.com/v1"},
            "kind": {"const": kind},
            "metadata": {
                "type": "object",
                "required": ["name", "namespace"],
                "properties": {
                    "name": {"type": "string"},
                    "namespace": {"type": "string"},
                    "labels": _STRING_MAP,
                },
            },
            "spec": {
                "type": "object",
                "required": ["selector"],
                "additionalProperties": False,
                "properties": {
                    "selector": {
                        "type": "object",
                        "additionalProperties": False,
                        "properties": {"matchLabels": _STRING_MAP},
                    },
                    endpoints: {"type": "array", "minItems": 1, "items": _ENDPOINT},
                },
            },
        },
    }


MONITOR_SCHEMAS = {
    "PodMonitor": _monitor_schema("PodMonitor", "podMetricsEndpoints"),
    "ServiceMonitor": _monitor_schema("ServiceMonitor", "endpoints"),
}

VARIANTS = {
    "deployment": k8s.K8sOptions(),
    "daemonset-pvc-servicemonitor": k8s.K8sOptions(
        kind="daemonset",
        volume="pvc",
        storage_class="local-path",
        monitor="servicemonitor",
        monitor_labels={"release": "kube-prometheus-stack"},
    ),
    "replicas-default-namespace": k8s.K8sOptions(replicas=3, namespace="default", volume="pvc"),
}


def validate(obj: dict[str, Any]) -> None:
    schema = MONITOR_SCHEMAS.get(obj["kind"])
    if schema is not None:
        jsonschema.validate(obj, schema)
    else:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def one(m: k8s.Manifests, kind: str) -> dict[str, Any]:
    found = [o for o in m.objects if o["kind"] == kind]
    assert len(found) == 1, f"{kind}: {len(found)}"
    return found[0]


def workload(m: k8s.Manifests) -> dict[str, Any]:
    found = [o for o in m.objects if o["kind"] in ("Deployment", "DaemonSet")]
    assert len(found) == 1
    return found[0]


def pod(m: k8s.Manifests) -> dict[str, Any]:
    spec: dict[str, Any] = workload(m)["spec"]["template"]["spec"]
    return spec


def server(m: k8s.Manifests) -> dict[str, Any]:
    (container,) = pod(m)["containers"]
    assert container["name"] == "server"
    return dict(container)


def all_containers(m: k8s.Manifests) -> list[dict[str, Any]]:
    p = pod(m)
    return [*p.get("initContainers", []), *p["containers"]]


def with_server(profile: str, **server: Any) -> Profile:
    p = load_profile(profile)
    data = p.model_dump(mode="json", exclude_unset=True)
    data.setdefault("server", {}).update(server)
    return parse_profile(yaml.safe_dump(data))


def hf_profile(**model: Any) -> Profile:
    data = load_profile("llama3.1-8b-q4_k_m").model_dump(mode="json", exclude_unset=True)
    data["model"] = {"hf": HF, "quantization": "Q4_K_M", **model}
    return parse_profile(yaml.safe_dump(data))


# --- every built-in profile renders objects the API server accepts


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("name", BUILTIN)
def test_every_object_validates_against_the_kubernetes_schemas(
    models: Path, name: str, variant: str
) -> None:
    m = render(models, name, VARIANTS[variant])
    kinds = [o["kind"] for o in m.objects]
    assert kinds[-3:-1] == ["DaemonSet" if "daemonset" in variant else "Deployment", "Service"]
    assert "ConfigMap" in kinds
    for obj in m.objects:
        validate(obj)


def test_the_schemas_catch_a_mistake(models: Path) -> None:
    """The validation is strict: a misspelled field fails it, in either kind of check."""
    m = render(models, "llama3.1-8b-q4_k_m")
    bad = dict(workload(m), spec={**workload(m)["spec"], "replica": 2})
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(bad)
    monitor = one(m, "PodMonitor")
    bad_monitor = {
        **monitor,
        "spec": {"podMetricsEndpoints": monitor["spec"]["podMetricsEndpoints"]},
    }
    with pytest.raises(jsonschema.ValidationError):
        validate(bad_monitor)


def test_an_hf_profile_validates_too(models: Path) -> None:
    for obj in render(models, hf_profile()).objects:
        validate(obj)


# --- the memory plan's figures


@pytest.mark.parametrize("name", BUILTIN)
def test_memory_request_and_limit_are_the_plans(models: Path, name: str) -> None:
    profile = load_profile(name)
    plan = k8s.plan_for(profile, model_info(models, profile.model.quantization))
    m = k8s.render(profile, plan)
    resources = server(m)["resources"]
    # the systemd unit's MemoryHigh and MemoryMax, from the same plan
    high = math.ceil((plan.total_bytes + PROCESS_OVERHEAD) / MiB) * MiB
    limit = math.ceil(int(high * (1 + MAX_OVER_HIGH)) / MiB) * MiB
    assert resources["requests"]["memory"] == f"{high // MiB}Mi"
    assert resources["limits"]["memory"] == f"{limit // MiB}Mi"
    assert (m.limits.memory_high, m.limits.memory_max) == (high, limit)
    assert set(resources["limits"]) == {"memory"}  # no CPU limit: it would throttle decoding


def test_a_bigger_plan_gets_bigger_limits_and_a_longer_startup(models: Path) -> None:
    profile = load_profile("llama2-13b-q4_k_m")
    plan = k8s.plan_for(profile, model_info(models, "Q4_K_M"))
    big = dataclasses.replace(plan, weights_bytes=plan.weights_bytes + 40 * GiB)
    small_m, big_m = k8s.render(profile, plan), k8s.render(profile, big)
    assert big_m.limits.memory_max - small_m.limits.memory_max >= 40 * GiB
    startup = server(big_m)["startupProbe"]
    budget = startup["periodSeconds"] * startup["failureThreshold"]
    assert budget >= big_m.limits.timeout_start_s > LOAD_FLOOR_S


# --- probes, drain and the server's /health


def health(state: str) -> int:
    status = EngineStatus(state, None, 4, 0, 0, 0, 0, 4096, None, 0)  # type: ignore[arg-type]
    engine: Any = type("Engine", (), {"status": lambda self: status})()
    return ServerState(engine=engine, model_name="m", metrics=None).health()[1]  # type: ignore[arg-type]


def test_health_is_200_only_once_the_model_serves() -> None:
    """What the probes rely on (orin/server/state.py): loading, draining and failed are
    503, so readiness passes only with the model loaded."""
    assert [health(s) for s in ("new", "loading", "ready", "draining", "failed")] == [
        503,
        503,
        200,
        503,
        503,
    ]


@pytest.mark.parametrize("port", [8080, 9000])
def test_probes_ask_health_on_the_servers_port(models: Path, port: int) -> None:
    m = render(models, with_server("llama2-7b-q4_k_m", port=port))
    c = server(m)
    (declared,) = c["ports"]
    assert declared["containerPort"] == port
    assert c["args"][c["args"].index("--port") + 1] == str(port)
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        get = c[probe]["httpGet"]
        assert get["path"] == "/health"
        assert get["port"] == declared["name"]
    svc = one(m, "Service")["spec"]["ports"][0]
    assert svc["port"] == port and svc["targetPort"] == declared["name"]
    assert c["args"][c["args"].index("--host") + 1] == "0.0.0.0"


def test_liveness_waits_for_the_model_and_is_generous(models: Path) -> None:
    c = server(render(models, "llama2-13b-q4_k_m"))
    startup, live = c["startupProbe"], c["livenessProbe"]
    # liveness and readiness start only after the startup probe saw a loaded model
    assert startup["periodSeconds"] * startup["failureThreshold"] >= LOAD_FLOOR_S
    assert live["periodSeconds"] * live["failureThreshold"] >= 60
    assert "initialDelaySeconds" not in live


@pytest.mark.parametrize("grace", [0, 30, 120.5])
def test_the_grace_period_covers_the_drain(models: Path, grace: float) -> None:
    m = render(models, with_server("llama3.1-8b-q4_k_m", grace_seconds=grace))
    p = pod(m)
    pre_stop = server(m)["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    # the preStop pause, then the drain's grace period and its margin
    assert p["terminationGracePeriodSeconds"] >= int(pre_stop[1]) + grace + STOP_MARGIN_S
    assert p["terminationGracePeriodSeconds"] == k8s.PRESTOP_S + m.limits.timeout_stop_s


# --- the model: volume and init container


@pytest.mark.parametrize("name", BUILTIN)
def test_no_init_container_without_an_hf_model(models: Path, name: str) -> None:
    assert load_profile(name).model.hf is None
    assert "initContainers" not in pod(render(models, name))


def test_an_hf_model_is_pulled_by_an_init_container(models: Path) -> None:
    m = render(models, hf_profile())
    (init,) = pod(m)["initContainers"]
    assert init["command"] + init["args"] == [
        "orin-llm",
        "model",
        "pull",
        HF,
        "--dir",
        SYSTEM_MODELS_DIR,
        "--quiet",
    ]
    assert {"name": "models", "mountPath": SYSTEM_MODELS_DIR} in init["volumeMounts"]
    token = next(e for e in init["env"] if e["name"] == "HF_TOKEN")
    assert token["valueFrom"]["secretKeyRef"]["optional"] is True
    # the server only reads the pulled file, and finds it offline by its reference
    mount = next(v for v in server(m)["volumeMounts"] if v["name"] == "models")
    assert mount == {"name": "models", "mountPath": SYSTEM_MODELS_DIR, "readOnly": True}
    served = parse_profile(one(m, "ConfigMap")["data"]["profile.yaml"])
    assert served.model.hf == HF
    # a pull may take long: the Deployment is not called stuck meanwhile
    plain = render(models, "llama3.1-8b-q4_k_m")
    deadline = workload(m)["spec"]["progressDeadlineSeconds"]
    assert deadline > workload(plain)["spec"]["progressDeadlineSeconds"]


def test_models_on_a_host_path_or_a_claim(models: Path) -> None:
    host = render(models, "llama3.1-8b-q4_k_m", k8s.K8sOptions(host_path="/data/models"))
    (models_volume,) = [v for v in pod(host)["volumes"] if v["name"] == "models"]
    assert models_volume["hostPath"] == {"path": "/data/models", "type": "DirectoryOrCreate"}
    assert not any(o["kind"] == "PersistentVolumeClaim" for o in host.objects)

    one_pod = render(models, "llama3.1-8b-q4_k_m", k8s.K8sOptions(volume="pvc", pvc_size="20Gi"))
    claim = one(one_pod, "PersistentVolumeClaim")
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert claim["spec"]["resources"]["requests"]["storage"] == "20Gi"
    (models_volume,) = [v for v in pod(one_pod)["volumes"] if v["name"] == "models"]
    assert models_volume["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    # several pods on several boards read one claim
    shared = render(models, "llama3.1-8b-q4_k_m", k8s.K8sOptions(volume="pvc", replicas=2))
    assert one(shared, "PersistentVolumeClaim")["spec"]["accessModes"] == ["ReadWriteMany"]


def test_demo_and_packaged_models_are_written_to_the_models_volume(models: Path) -> None:
    for name in ("demo", "smollm2"):
        mounts = server(render(models, name))["volumeMounts"]
        models_mounts = {v["mountPath"]: v for v in mounts if v["name"] == "models"}
        assert set(models_mounts) == {SYSTEM_MODELS_DIR, "/var/cache/orin-llm/models"}
        assert not models_mounts[SYSTEM_MODELS_DIR]["readOnly"]


# --- the profile as a ConfigMap


@pytest.mark.parametrize("name", BUILTIN)
def test_the_configmap_holds_the_profile(models: Path, name: str) -> None:
    m = render(models, name)
    text = one(m, "ConfigMap")["data"]["profile.yaml"]
    assert parse_profile(text).model_dump() == load_profile(name).model_dump()
    mount = next(v for v in server(m)["volumeMounts"] if v["name"] == "profile")
    args = server(m)["args"]
    assert args[:3] == ["serve", "--profile", f"{mount['mountPath']}/profile.yaml"]
    assert mount["readOnly"] is True
    # a changed profile changes the pod template, so the pods roll
    annotations = workload(m)["spec"]["template"]["metadata"]["annotations"]
    assert len(annotations[k8s.PROFILE_HASH]) == 16


def test_a_model_outside_the_models_folder_moves_into_it(models: Path, tmp_path: Path) -> None:
    source = tmp_path / "mine.yaml"
    data = load_profile("llama2-7b-q4_k_m").model_dump(mode="json", exclude_unset=True)
    data["model"]["path"] = "weights/llama-7b.Q4_K_M.gguf"  # relative to the profile
    source.write_text(yaml.safe_dump(data), encoding="utf-8")
    m = render(models, load_profile(source))
    served = parse_profile(one(m, "ConfigMap")["data"]["profile.yaml"])
    assert served.model.path == f"{SYSTEM_MODELS_DIR}/llama-7b.Q4_K_M.gguf"
    assert any("model.path" in note for note in m.notes)


def test_a_vision_projector_outside_the_models_folder_moves_into_it(
    models: Path, tmp_path: Path
) -> None:
    """model.mmproj is a file the pods read as model.path is: one that stayed at its
    path on this machine would not be in the pod, and the model would not load."""
    from orin.model import mmproj

    projector = mmproj.generate("tiny", tmp_path / "llava" / "mmproj-f16.gguf")
    source = tmp_path / "vision.yaml"
    data = load_profile("llama2-7b-q4_k_m").model_dump(mode="json", exclude_unset=True)
    data["model"]["path"] = f"{SYSTEM_MODELS_DIR}/llama-7b.Q4_K_M.gguf"
    data["model"]["mmproj"] = str(projector)
    source.write_text(yaml.safe_dump(data), encoding="utf-8")
    m = render(models, load_profile(source))
    served = parse_profile(one(m, "ConfigMap")["data"]["profile.yaml"])
    assert served.model.mmproj == f"{SYSTEM_MODELS_DIR}/mmproj-f16.gguf"
    assert served.model.path == f"{SYSTEM_MODELS_DIR}/llama-7b.Q4_K_M.gguf"
    assert [n for n in m.notes if n.startswith("model.")] == [
        f"model.mmproj: {projector} is {SYSTEM_MODELS_DIR}/mmproj-f16.gguf "
        "in the pods; put the file there on each board (or in the models volume)"
    ]


def test_the_memory_limits_count_the_vision_projector(models: Path, tmp_path: Path) -> None:
    """The pods load model.mmproj beside the model: its weights and compute buffer are
    in the limits, read from the profile's file or a copy (--mmproj). A projector that
    is in neither place stops the render, as a missing model does, rather than limits
    the kernel would kill the server by when the projector loads."""
    from orin.errors import ModelFileError
    from orin.model import mmproj

    projector = mmproj.generate("small", tmp_path / "mmproj.gguf")
    size = mmproj.read_projector_info(projector).total_bytes
    text = load_profile("llama2-7b-q4_k_m")
    info = model_info(models, text.model.quantization)
    data = text.model_dump(mode="json", exclude_unset=True)
    data["model"]["mmproj"] = str(projector)
    vision = parse_profile(yaml.safe_dump(data))
    data["model"]["mmproj"] = "/home/me/elsewhere/mmproj.gguf"
    elsewhere = parse_profile(yaml.safe_dump(data))
    base = k8s.plan_for(text, info).total_bytes
    assert k8s.plan_for(vision, info).total_bytes == base + size
    assert k8s.plan_for(elsewhere, info, projector).total_bytes == base + size
    with pytest.raises(ModelFileError, match=r"elsewhere/mmproj\.gguf \(model\.mmproj\).*--mmproj"):
        k8s.plan_for(elsewhere, info)
    with pytest.raises(ModelFileError, match="not a vision projector"):
        k8s.plan_for(elsewhere, info, models / "model-Q4_K_M.gguf")


def test_the_memory_limits_count_the_draft_model(models: Path) -> None:
    """speculative.mode draft loads a second model with a cache of its own in the pod:
    the plan, and with it the memory request and limit, is larger by the draft's
    weights and cache, read from the profile's file or a copy (--draft-model)."""
    from orin.errors import ModelFileError
    from orin.model.memplan import draft_bytes

    plain = load_profile("llama2-7b-q4_k_m")
    info = model_info(models, plain.model.quantization)
    draft_file = models / "model-Q4_K_M.gguf"  # the model itself, as its own draft
    data = plain.model_dump(mode="json", exclude_unset=True)
    data["speculative"] = {"mode": "draft", "draft_model": str(draft_file)}
    here = parse_profile(yaml.safe_dump(data))
    data["speculative"]["draft_model"] = "/home/me/elsewhere/draft.gguf"
    elsewhere = parse_profile(yaml.safe_dump(data))
    e = plain.engine
    extra = draft_bytes(info, e.n_ctx, e.slots, e.n_ubatch, True, e.n_batch)
    base = k8s.plan_for(plain, info)
    assert k8s.plan_for(here, info).total_bytes == base.total_bytes + extra
    assert k8s.plan_for(elsewhere, info, draft=draft_file).total_bytes == base.total_bytes + extra
    with pytest.raises(ModelFileError, match=r"draft\.gguf \(speculative\.draft_model\)"):
        k8s.plan_for(elsewhere, info)
    limits = k8s.unit_limits(here, k8s.plan_for(here, info))
    assert limits.memory_max > k8s.unit_limits(plain, base).memory_max


def test_an_rpc_worker_on_loopback_is_said_to_be_the_pods_own(models: Path) -> None:
    """engine.rpc on 127.0.0.1 names a worker on the board itself; in a pod it is the
    pod's own loopback, where no worker listens, and every start would exit 6."""
    data = load_profile("llama2-7b-q4_k_m").model_dump(mode="json", exclude_unset=True)
    data.setdefault("engine", {})["rpc"] = ["127.0.0.1:50052", "10.0.0.3:50052"]
    m = render(models, parse_profile(yaml.safe_dump(data)))
    assert [n for n in m.notes if n.startswith("engine.rpc")] == [
        "engine.rpc: 127.0.0.1:50052 is the pod's own loopback address, where no RPC "
        "worker listens: the pods would exit 6; name the worker boards' addresses in "
        "the profile"
    ]
    data["engine"]["rpc"] = ["10.0.0.3:50052"]
    m = render(models, parse_profile(yaml.safe_dump(data)))
    assert not [n for n in m.notes if n.startswith("engine.rpc")]


def test_a_prompt_folder_travels_in_the_config_map(models: Path, tmp_path: Path) -> None:
    """prompt_cache.prompt_dir and .directory are folders of the machine that renders
    the manifests: the prompts go into the ConfigMap, the states into the pods' cache."""
    (tmp_path / "prompts").mkdir()
    (tmp_path / "prompts" / "b.txt").write_text("You answer in French.", encoding="utf-8")
    (tmp_path / "prompts" / "a.txt").write_text("You are a car's assistant.", encoding="utf-8")
    (tmp_path / "prompts" / "notes.md").write_text("not a prompt", encoding="utf-8")
    source = tmp_path / "cached.yaml"
    data = load_profile("llama2-7b-q4_k_m").model_dump(mode="json", exclude_unset=True)
    data["model"]["path"] = f"{SYSTEM_MODELS_DIR}/llama-7b.Q4_K_M.gguf"
    data["prompt_cache"] = {
        "prompts": ["Be brief."],
        "prompt_dir": "prompts",
        "directory": "/home/me/kv",
        "max_bytes": 1024**3,
    }
    source.write_text(yaml.safe_dump(data), encoding="utf-8")
    m = render(models, load_profile(source))
    served = parse_profile(one(m, "ConfigMap")["data"]["profile.yaml"])
    pc = served.prompt_cache
    assert pc.prompts == ["Be brief.", "You are a car's assistant.", "You answer in French."]
    assert (pc.prompt_dir, pc.directory, pc.max_bytes) == (None, None, 1024**3)
    notes = [n for n in m.notes if n.startswith("prompt_cache.")]
    assert len(notes) == 2 and "2 prompts" in notes[0] and k8s.CACHE_DIR in notes[1]
    # a profile without those folders is served as written, comments and all
    plain = load_profile("llama2-7b-q4_k_m")
    text = one(render(models, plain), "ConfigMap")["data"]["profile.yaml"]
    assert text.endswith(plain.source.read_text(encoding="utf-8"))  # type: ignore[union-attr]


def test_a_missing_prompt_folder_stops_the_render(models: Path, tmp_path: Path) -> None:
    source = tmp_path / "cached.yaml"
    data = load_profile("llama2-7b-q4_k_m").model_dump(mode="json", exclude_unset=True)
    data["prompt_cache"] = {"prompt_dir": "nowhere"}
    source.write_text(yaml.safe_dump(data), encoding="utf-8")
    with pytest.raises(ProfileError, match=r"prompt_cache\.prompt_dir: .*nowhere"):
        render(models, load_profile(source))


# --- no root, and the API key from a Secret


@pytest.mark.parametrize("profile", ["llama3.1-8b-q4_k_m", "demo", "hf"])
def test_nothing_runs_as_root(models: Path, profile: str) -> None:
    m = render(models, hf_profile() if profile == "hf" else profile)
    p = pod(m)
    assert p["securityContext"]["runAsNonRoot"] is True
    assert p["securityContext"]["runAsUser"] != 0
    assert p["securityContext"]["runAsGroup"] != 0
    assert p["automountServiceAccountToken"] is False
    assert p["runtimeClassName"] == "nvidia"
    containers = all_containers(m)
    assert len(containers) == (2 if profile == "hf" else 1)
    for c in containers:
        sc = c["securityContext"]
        assert sc["runAsNonRoot"] is True
        assert sc["allowPrivilegeEscalation"] is False
        assert sc["privileged"] is False
        assert sc["readOnlyRootFilesystem"] is True
        assert sc["capabilities"] == {"drop": ["ALL"]}
        assert "runAsUser" not in sc or sc["runAsUser"] != 0
        # what a read-only root needs written goes to volumes
        paths = {v["mountPath"] for v in c["volumeMounts"]}
        assert {"/tmp", "/var/cache/orin-llm"} <= paths


@pytest.mark.parametrize("env", ["ORIN_LLM_API_KEY", "FLEET_KEY"])
def test_the_api_key_comes_from_a_secret(models: Path, env: str) -> None:
    m = render(models, with_server("llama3.1-8b-q4_k_m", api_key_env=env))
    (key,) = [e for e in server(m)["env"] if e["name"] == env]
    ref = key["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "orin-llm-llama3-1-8b-q4-k-m-api-key", "key": "api-key"}
    assert "optional" not in ref  # no key, no server: never an open one by accident
    auth = one(m, "PodMonitor")["spec"]["podMetricsEndpoints"][0]["authorization"]
    assert auth == {"type": "Bearer", "credentials": ref}
    assert any(f"secret generic {ref['name']}" in note for note in m.notes)
    named = render(
        models,
        with_server("llama3.1-8b-q4_k_m", api_key_env=env),
        k8s.K8sOptions(api_key_secret="fleet"),
    )
    (key,) = [e for e in server(named)["env"] if e["name"] == env]
    assert key["valueFrom"]["secretKeyRef"]["name"] == "fleet"


def test_public_metrics_and_no_key(models: Path) -> None:
    public = render(models, with_server("llama3.1-8b-q4_k_m", metrics_public=True))
    assert "authorization" not in one(public, "PodMonitor")["spec"]["podMetricsEndpoints"][0]
    open_ = render(models, with_server("llama3.1-8b-q4_k_m", api_key_env=None))
    assert not any("valueFrom" in e for e in server(open_)["env"])
    assert any("no server.api_key_env" in note for note in open_.notes)


def test_no_service_links_shadow_the_servers_variables(models: Path) -> None:
    """A Service named orin-llm would give the pods ORIN_LLM_PORT=tcp://..., which
    serve reads."""
    m = render(models, "demo", k8s.K8sOptions(name="orin-llm"))
    assert one(m, "Service")["metadata"]["name"] == "orin-llm"
    assert pod(m)["enableServiceLinks"] is False


# --- placement


def test_one_pod_per_board(models: Path) -> None:
    dep = render(models, "llama2-13b-q4_k_m", k8s.K8sOptions(replicas=3))
    spec = workload(dep)["spec"]
    assert spec["replicas"] == 3
    assert spec["strategy"]["rollingUpdate"] == {"maxSurge": 0, "maxUnavailable": 1}
    (term,) = pod(dep)["affinity"]["podAntiAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"
    ]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert term["labelSelector"]["matchLabels"] == spec["selector"]["matchLabels"]
    assert pod(dep)["nodeSelector"] == {
        "kubernetes.io/arch": "arm64",
        k8s.BOARD_LABEL: "agx-orin-64gb",
    }
    ds = render(models, "llama2-13b-q4_k_m-32gb", k8s.K8sOptions(kind="daemonset"))
    assert workload(ds)["kind"] == "DaemonSet"
    assert "replicas" not in workload(ds)["spec"] and "affinity" not in pod(ds)
    assert pod(ds)["nodeSelector"][k8s.BOARD_LABEL] == "agx-orin-32gb"
    anywhere = render(models, "demo")
    assert pod(anywhere)["nodeSelector"] == {"kubernetes.io/arch": "arm64"}
    chosen = render(models, "demo", k8s.K8sOptions(node_selector={"fleet": "a"}))
    assert pod(chosen)["nodeSelector"] == {"fleet": "a"}


def test_gpu_groups_are_supplementary_groups(models: Path) -> None:
    default = render(models, "demo")
    assert pod(default)["securityContext"]["supplementalGroups"] == [k8s.VIDEO_GID]
    more = render(models, "demo", k8s.K8sOptions(gpu_groups=(44, 993)))
    assert pod(more)["securityContext"]["supplementalGroups"] == [44, 993]


def test_restricted_pod_security_only_without_a_host_path(models: Path) -> None:
    host = one(render(models, "demo"), "Namespace")["metadata"]["labels"]
    assert "pod-security.kubernetes.io/enforce" not in host
    pvc = one(render(models, "demo", k8s.K8sOptions(volume="pvc")), "Namespace")
    assert pvc["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    default_ns = render(models, "demo", k8s.K8sOptions(namespace="default"))
    assert not any(o["kind"] == "Namespace" for o in default_ns.objects)
    assert {o["metadata"].get("namespace") for o in default_ns.objects} == {"default"}


def test_no_monitor_when_asked(models: Path) -> None:
    m = render(models, "demo", k8s.K8sOptions(monitor="none"))
    assert not any(o["apiVersion"].startswith("monitoring.coreos.com") for o in m.objects)


# --- output and names


def test_yaml_and_files_hold_the_same_objects(models: Path, tmp_path: Path) -> None:
    m = render(models, "llama3.1-8b-q4_k_m")
    assert list(yaml.safe_load_all(m.yaml())) == list(m.objects)
    written, removed = m.write(tmp_path / "out")
    assert removed == []
    assert [p.name for p in written] == sorted(p.name for p in written)
    assert [yaml.safe_load(p.read_text()) for p in written] == list(m.objects)
    assert written[0].name == "01-namespace.yaml"
    # the profile stays readable: a block scalar, comments included
    assert "profile.yaml: |" in m.yaml()


@pytest.mark.parametrize(
    ("profile", "name"),
    [
        ("llama3.1-8b-q4_k_m", "orin-llm-llama3-1-8b-q4-k-m"),
        ("demo", "orin-llm-demo"),
        ("orin-llm", "orin-llm"),
        ("Qwen2.5_1.5B!!", "orin-llm-qwen2-5-1-5b"),
        ("x" * 100, "orin-llm-" + "x" * 43),
    ],
)
def test_resource_names(profile: str, name: str) -> None:
    assert k8s.resource_name(profile) == name
    assert k8s.check_name(name) == name


@pytest.mark.parametrize("bad", ["Orin", "1fleet", "fleet-", "a_b", "x" * 53, ""])
def test_bad_names_are_refused(bad: str) -> None:
    with pytest.raises(ValueError):
        k8s.check_name(bad)


def test_labels() -> None:
    assert k8s.parse_labels(["orin-llm/board=agx-orin-64gb", "release=kps"]) == {
        "orin-llm/board": "agx-orin-64gb",
        "release": "kps",
    }
    for bad in ["novalue", "=x", "a/b/c=1", "k=bad value", "k=" + "v" * 64]:
        with pytest.raises(ValueError):
            k8s.parse_labels([bad])
    assert k8s.label_value("-my profile (v2)-") == "my-profile-v2"


def test_the_model_for_the_plan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORIN_LLM_CACHE_DIR", str(tmp_path / "cache"))
    profile = load_profile("llama3.1-8b-q4_k_m")
    with pytest.raises(k8s.ModelFileError, match="--model PATH"):
        k8s.model_for_plan(profile)
    info = model_info(tmp_path, "Q4_K_M")
    path, got = k8s.model_for_plan(profile, tmp_path / "model-Q4_K_M.gguf")
    assert path.name == "model-Q4_K_M.gguf" and got.quantization == info.quantization
    with pytest.raises(k8s.ModelFileError, match="model pull"):
        k8s.model_for_plan(hf_profile())


def test_a_new_rendering_removes_the_files_of_the_last(models: Path, tmp_path: Path) -> None:
    folder = tmp_path / "out"
    with_claim = render(models, "demo", k8s.K8sOptions(volume="pvc"))
    with_claim.write(folder)
    (folder / "99-mine.yaml").write_text("kind: ConfigMap\n")  # not ours: kept
    (folder / "notes.txt").write_text("kept\n")
    written, removed = render(models, "demo").write(folder)
    assert [p.name for p in removed] == [
        "03-persistentvolumeclaim.yaml",
        "04-deployment.yaml",
        "05-service.yaml",
        "06-podmonitor.yaml",
    ]
    names = {p.name for p in folder.iterdir()}
    assert names == {p.name for p in written} | {"99-mine.yaml", "notes.txt"}
