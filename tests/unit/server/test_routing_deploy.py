"""deploy/gateway/: the Inference Extension's objects for an orin-llm pool, checked for structure.

No cluster and no CRD schema here (kubernetes-validate knows only built-in
kinds), so the rules of the CRDs' OpenAPI schemas that a hand-written file can
break are checked directly: required fields, enums, bounds and label syntax
of InferencePool v1 and InferenceObjective v1alpha2, and that the files refer
to each other and to the orin-llm profile consistently.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from orin.profile.loader import parse_profile
from orin.server.metrics import ServerMetrics
from orin.server.routing import STYLES, effective_style

GATEWAY = Path(__file__).resolve().parents[3] / "deploy" / "gateway"

POOL_API = "inference.networking.k8s.io/v1"
POOL_GROUP = "inference.networking.k8s.io"
OBJECTIVE_API = "inference.networking.x-k8s.io/v1alpha2"
# The EPP's built-in vLLM mapping (its default engine): queue, running, KV usage, cache info.
EPP_VLLM_DEFAULTS = (
    "vllm:num_requests_waiting",
    "vllm:num_requests_running",
    "vllm:kv_cache_usage_perc",
    "vllm:cache_config_info",
)
# Refused by the EPP since v1.4 (the names moved to the configuration's engineConfigs).
EPP_REMOVED_FLAGS = (
    "--total-queued-requests-metric",
    "--total-running-requests-metric",
    "--kv-cache-usage-percentage-metric",
    "--lora-info-metric",
    "--cache-info-metric",
)

# Patterns of the CRDs' LabelKey, LabelValue and of Kubernetes object names.
LABEL_KEY = re.compile(
    r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
    r"([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9]$"
)
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def documents() -> list[dict[str, Any]]:
    docs = []
    for path in sorted(GATEWAY.glob("*.yaml")):
        if path.name == "profile.yaml":  # an orin-llm profile, not a Kubernetes object
            continue
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    return docs


def one(kind: str) -> dict[str, Any]:
    (doc,) = [d for d in documents() if d["kind"] == kind]
    return doc


def all_of(kind: str) -> list[dict[str, Any]]:
    return [d for d in documents() if d["kind"] == kind]


def test_every_object_has_a_kind_and_a_valid_name() -> None:
    docs = documents()
    assert {d["kind"] for d in docs} >= {
        "InferencePool",
        "InferenceObjective",
        "HTTPRoute",
        "Gateway",
        "Deployment",
        "Service",
        "ConfigMap",
    }
    for d in docs:
        assert set(d) >= {"apiVersion", "kind", "metadata"}, d
        name = d["metadata"]["name"]
        assert DNS_SUBDOMAIN.match(name) and len(name) <= 253, name
        assert "namespace" not in d["metadata"]  # applied with -n: everything in one namespace


def test_inference_pool_follows_the_v1_schema() -> None:
    pool = one("InferencePool")
    assert pool["apiVersion"] == POOL_API
    spec = pool["spec"]
    assert set(spec) <= {"selector", "targetPorts", "appProtocol", "endpointPickerRef"}
    labels = spec["selector"]["matchLabels"]
    assert set(spec["selector"]) == {"matchLabels"}  # the v1 selector has matchLabels only
    assert 1 <= len(labels) <= 64
    for key, value in labels.items():
        assert LABEL_KEY.match(key) and len(key) <= 253, key
        assert isinstance(value, str) and LABEL_VALUE.match(value) and len(value) <= 63, value
    ports = [p["number"] for p in spec["targetPorts"]]
    assert 1 <= len(ports) <= 8 and len(set(ports)) == len(ports)
    assert all(isinstance(p, int) and 1 <= p <= 65535 for p in ports)
    assert spec.get("appProtocol", "http") in ("http", "kubernetes.io/h2c")
    epp = spec["endpointPickerRef"]
    assert set(epp) <= {"group", "kind", "name", "port", "failureMode"}
    assert 1 <= len(epp["name"]) <= 253
    if epp.get("kind", "Service") == "Service":
        assert 1 <= epp["port"]["number"] <= 65535  # required for a Service
    assert epp.get("failureMode", "FailClose") in ("FailOpen", "FailClose")


def test_objectives_follow_the_v1alpha2_schema_and_name_the_pool() -> None:
    pool = one("InferencePool")["metadata"]["name"]
    objectives = all_of("InferenceObjective")
    assert objectives
    for o in objectives:
        assert o["apiVersion"] == OBJECTIVE_API
        spec = o["spec"]
        assert set(spec) <= {"priority", "poolRef"}
        assert isinstance(spec.get("priority", 0), int)
        assert -(2**31) <= spec.get("priority", 0) < 2**31
        ref = spec["poolRef"]
        assert set(ref) <= {"group", "kind", "name"}
        assert ref.get("group", POOL_GROUP) == POOL_GROUP
        assert ref.get("kind", "InferencePool") == "InferencePool"
        assert ref["name"] == pool


def test_the_route_sends_the_gateways_traffic_to_the_pool() -> None:
    route, gateway, pool = one("HTTPRoute"), one("Gateway"), one("InferencePool")
    assert route["apiVersion"] == gateway["apiVersion"] == "gateway.networking.k8s.io/v1"
    (parent,) = route["spec"]["parentRefs"]
    assert parent.get("kind", "Gateway") == "Gateway"
    assert parent["name"] == gateway["metadata"]["name"]
    backends = [b for rule in route["spec"]["rules"] for b in rule["backendRefs"]]
    assert backends == [
        {"group": POOL_GROUP, "kind": "InferencePool", "name": pool["metadata"]["name"]}
    ]
    assert gateway["spec"]["gatewayClassName"] and gateway["spec"]["listeners"]


def test_the_epp_serves_the_pool_and_reads_a_valid_configuration() -> None:
    pool, service = one("InferencePool"), one("Service")
    deployment, config_map = one("Deployment"), one("ConfigMap")
    ref = pool["spec"]["endpointPickerRef"]
    assert service["metadata"]["name"] == ref["name"]
    assert ref["port"]["number"] in [p["port"] for p in service["spec"]["ports"]]
    pod = deployment["spec"]["template"]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    assert (
        deployment["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
    )
    (container,) = pod["spec"]["containers"]
    args = dict(a.split("=", 1) for a in container["args"])
    assert args["--pool-name"] == pool["metadata"]["name"]
    assert not set(args) & set(EPP_REMOVED_FLAGS)
    assert ref["port"]["number"] in [p["containerPort"] for p in container["ports"]]
    mount = container["volumeMounts"][0]["mountPath"]
    file = args["--config-file"].removeprefix(mount + "/")
    config = yaml.safe_load(config_map["data"][file])
    assert config["kind"] == "EndpointPickerConfig"
    plugins = {p["type"] for p in config["plugins"]}
    assert {"metrics-data-source", "core-metrics-extractor"} <= plugins
    refs = {p["pluginRef"] for prof in config["schedulingProfiles"] for p in prof["plugins"]}
    assert refs <= plugins
    assert pod["spec"]["serviceAccountName"] == one("ServiceAccount")["metadata"]["name"]


def test_the_pool_members_profile_exports_what_the_epp_reads() -> None:
    profile = parse_profile((GATEWAY / "profile.yaml").read_text())
    server = profile.server
    pool = one("InferencePool")
    assert server.port in [p["number"] for p in pool["spec"]["targetPorts"]]
    assert server.metrics_public  # the EPP holds no API key
    style = STYLES[effective_style(server)]
    assert style.names() == EPP_VLLM_DEFAULTS
    # and 'auto' gives the same on the address a pod listens on
    server.routing_metrics.style = "auto"
    assert effective_style(server) == "vllm"


def test_orin_llm_names_the_files_mention_exist() -> None:
    text = "\n".join(p.read_text() for p in GATEWAY.glob("*.yaml"))
    mentioned = set(re.findall(r"\borin_llm_[a-z_]+", text))
    assert mentioned
    exposition = ServerMetrics(2, 1024, "m").render()[0].decode()
    exported = {s.name for f in text_string_to_metric_families(exposition) for s in f.samples}
    assert mentioned <= exported


@pytest.mark.parametrize("path", sorted(GATEWAY.glob("*.yaml")), ids=lambda p: p.name)
def test_files_are_plain_yaml(path: Path) -> None:
    """No tabs, no templating: kubectl apply -f takes them as they are."""
    text = path.read_text()
    assert "\t" not in text and "{{" not in text
    assert list(yaml.safe_load_all(text))
