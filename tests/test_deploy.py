"""The Kubernetes manifests and the Dockerfile, validated offline (no cluster, no Docker engine here).

The overlays are rendered the way kustomize renders these files (resources, the common label,
image overrides, JSON 6902 patches by kind and name pattern), every object is validated strictly
against the Kubernetes 1.33 schema (``kubernetes-validate``), and every container's arguments are
parsed by pdserve's own command-line parser, so a manifest cannot name a flag pdserve lacks.
"""

from __future__ import annotations

import pathlib
import re
import shlex

import jsonpatch
import kubernetes_validate
import pytest
import yaml
from dockerfile_parse import DockerfileParser

from pdserve.cli import build_parser

ROOT = pathlib.Path(__file__).resolve().parents[1]
K8S = ROOT / "k8s"
K8S_VERSION = "1.33"


def render(directory: pathlib.Path) -> list[dict]:
    """The objects of a kustomization directory (the subset of kustomize these files use)."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    objects: list[dict] = []
    for resource in kustomization.get("resources", []):
        path = (directory / resource).resolve()
        objects += render(path) if path.is_dir() else [o for o in yaml.safe_load_all(path.read_text()) if o]
    for entry in kustomization.get("labels", []):
        for obj in objects:
            obj.setdefault("metadata", {}).setdefault("labels", {}).update(entry["pairs"])
    for image in kustomization.get("images", []):
        for obj in objects:
            for container in _containers(obj):
                if container["image"].split(":")[0] == image["name"] or container["image"].startswith(
                        image.get("newName", "\0")):
                    container["image"] = f"{image.get('newName', image['name'])}:{image['newTag']}"
    for patch in kustomization.get("patches", []):
        target = patch["target"]
        ops = jsonpatch.JsonPatch(yaml.safe_load(patch["patch"]))
        matched = [i for i, o in enumerate(objects) if o["kind"] == target["kind"]
                   and re.fullmatch(target["name"], o["metadata"]["name"])]
        assert matched, f"patch in {directory} matches nothing: {target}"
        for i in matched:
            objects[i] = ops.apply(objects[i])
    return objects


def _containers(obj: dict) -> list[dict]:
    return obj.get("spec", {}).get("template", {}).get("spec", {}).get("containers", [])


def by_kind_name(objects: list[dict]) -> dict[tuple[str, str], dict]:
    return {(o["kind"], o["metadata"]["name"]): o for o in objects}


@pytest.fixture(scope="module", params=["cpu", "gpu"])
def overlay(request):
    return request.param, render(K8S / "overlays" / request.param)


def test_every_object_validates_strictly_against_kubernetes_1_33(overlay):
    _, objects = overlay
    assert len(objects) == 11  # ConfigMap, router Deployment + 2 Services, 2 pools, 2 HPAs, 3 PDBs
    for obj in objects:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_router_pools_autoscalers_and_budgets(overlay):
    name, objects = overlay
    o = by_kind_name(objects)
    for role in ("prefill", "decode"):
        deployment = o[("Deployment", f"pdserve-{role}")]
        hpa = o[("HorizontalPodAutoscaler", f"pdserve-{role}")]
        assert hpa["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
        assert hpa["spec"]["metrics"][0]["external"]["metric"]["name"].startswith(f"pdserve_{role}_")
        budget = o[("PodDisruptionBudget", f"pdserve-{role}")]
        assert budget["spec"]["selector"]["matchLabels"] == deployment["spec"]["selector"]["matchLabels"]
        pod = deployment["spec"]["template"]["spec"]
        container = pod["containers"][0]
        assert pod["terminationGracePeriodSeconds"] >= 30 and "preStop" in container["lifecycle"]
        assert {"livenessProbe", "readinessProbe", "startupProbe"} <= set(container)
        limits = container["resources"]["limits"]
        assert ("nvidia.com/gpu" in limits) == (name == "gpu")
        assert container["args"][container["args"].index("--device") + 1] == ("cuda" if name == "gpu" else "cpu")
    router = o[("Deployment", "pdserve-router")]
    assert router["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["path"] == "/ready"
    service, zmq_service = o[("Service", "pdserve-router")], o[("Service", "pdserve-router-zmq")]
    assert service["spec"]["selector"] == zmq_service["spec"]["selector"] == router["spec"]["selector"]["matchLabels"]
    # Workers reach a router that is not ready yet (it gets ready once they register): a Service of its own.
    assert zmq_service["spec"]["publishNotReadyAddresses"] and [p["port"] for p in zmq_service["spec"]["ports"]] == [8001]
    # A router tier: 2+ replicas, a budget that keeps one up through a voluntary disruption, and a headless
    # ZMQ Service, whose DNS name gives the workers every router pod (a ClusterIP would give them one).
    router_budget = o[("PodDisruptionBudget", "pdserve-router")]
    assert router["spec"]["replicas"] >= 2 and 1 <= router_budget["spec"]["minAvailable"] < router["spec"]["replicas"]
    assert router_budget["spec"]["selector"]["matchLabels"] == router["spec"]["selector"]["matchLabels"]
    assert zmq_service["spec"]["clusterIP"] == "None" and "clusterIP" not in service["spec"]
    anti = router["spec"]["template"]["spec"]["affinity"]["podAntiAffinity"]
    term = anti["preferredDuringSchedulingIgnoredDuringExecution"][0]["podAffinityTerm"]
    assert term["labelSelector"]["matchLabels"] == router["spec"]["selector"]["matchLabels"]
    assert [p["port"] for p in service["spec"]["ports"]] == [8000]
    assert o[("ConfigMap", "pdserve-config")]["data"]["ROUTER_ZMQ"] == "tcp://pdserve-router-zmq:8001"  # Service DNS
    assert all(c["image"].startswith("ghcr.io/pdserve/pdserve:") for obj in objects for c in _containers(obj))


def test_container_arguments_are_real_pdserve_commands(overlay):
    """Expand $(VAR) from the ConfigMap and the downward API, then parse with pdserve's own parser."""
    _, objects = overlay
    config = by_kind_name(objects)[("ConfigMap", "pdserve-config")]["data"]
    env = {**config, "POD_IP": "10.1.2.3", "POD_NAME": "pdserve-decode-abc"}
    parser = build_parser()
    for obj in objects:
        for container in _containers(obj):
            args = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in container["args"]]
            parsed, extra = parser.parse_known_args(args)
            assert extra == [], (container["name"], extra)
            assert parsed.command in ("router", "prefill", "decode")
            if parsed.command != "router":
                assert parsed.router_addr == "tcp://pdserve-router-zmq:8001" and parsed.host == "10.1.2.3"
            else:  # /ready waits for the prefill pool the manifests start
                assert parsed.expect_prefill_workers == int(config["EXPECT_PREFILL_WORKERS"]) == 1
                # each replica names itself (request ids never collide); pool sizes are the Deployments'
                assert parsed.router_id == env["POD_NAME"] and parsed.pool_owner == "none"
                assert {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}} in \
                    container["env"]


def test_dockerfile_parses_and_its_entrypoint_is_pdserve():
    parser = DockerfileParser(path=str(ROOT / "Dockerfile"))
    assert parser.baseimage.startswith("python:3.11")
    instructions = {i["instruction"]: i["value"] for i in parser.structure}
    assert yaml.safe_load(instructions["ENTRYPOINT"]) == ["pdserve"]
    cmd = yaml.safe_load(instructions["CMD"])
    parsed = build_parser().parse_known_args(cmd)[0]
    assert parsed.command == "up" and parsed.model == "/opt/pdserve/default_model/default"
    runs = [i["value"] for i in parser.structure if i["instruction"] == "RUN"]
    assert any("pdserve default-model /opt/pdserve/default_model/default" in r for r in runs)  # what CMD serves exists
    for copied in re.findall(r"^COPY (\S+)", parser.content, re.M):
        assert (ROOT / copied).exists(), copied
    assert shlex.split(instructions["USER"]) == ["pdserve"]  # not root
