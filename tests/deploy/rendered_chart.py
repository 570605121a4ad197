"""The Helm chart rendered by real Helm (helm-python-sdk: Helm v4's Go SDK in-process, no binary), parsed into
Kubernetes objects and held to the `kubernetes` client's models, with look-ups the wiring tests share."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import helm_python as helm
import kubernetes.client
import yaml

CHART = Path(__file__).resolve().parents[2] / "charts" / "specserve"
RELEASE, NAMESPACE = "rel", "inference"


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML that refuses a key given twice in one mapping (PyYAML would silently keep the last one, as would
    the API server's decoder; a template that emits a label twice is a bug)."""

    def construct_mapping(self, node, deep=False):
        keys = [self.construct_object(key, deep=deep) for key, _ in node.value]
        duplicates = {key for key in keys if keys.count(key) > 1}
        if duplicates:
            raise yaml.constructor.ConstructorError(None, None, f"duplicate keys {duplicates}", node.start_mark)
        return super().construct_mapping(node, deep)


def values_file(name: str) -> dict[str, Any]:
    return yaml.safe_load((CHART / "ci" / name).read_text())


def model_class(manifest: dict[str, Any]) -> type:
    """The client's model for a manifest: apps/v1 Deployment -> V1Deployment, autoscaling/v2 ... -> V2..."""
    version = manifest["apiVersion"].rpartition("/")[2]
    return getattr(kubernetes.client, version.capitalize() + manifest["kind"])


@dataclass
class RenderedChart:
    values: dict[str, Any]  # as given (the chart's defaults fill the rest)
    manifests: list[dict[str, Any]]
    notes: str

    def of_kind(self, kind: str) -> list[dict[str, Any]]:
        return [m for m in self.manifests if m["kind"] == kind]

    def get(self, kind: str, name: str) -> dict[str, Any]:
        found = [m for m in self.of_kind(kind) if m["metadata"]["name"] == name]
        assert len(found) == 1, f"{kind}/{name}: {len(found)} rendered"
        return found[0]

    def config_env(self, workload: dict[str, Any]) -> dict[str, str]:
        """The environment a Deployment's first container gets from the ConfigMaps it names in envFrom."""
        env = {}
        for source in workload["spec"]["template"]["spec"]["containers"][0].get("envFrom", []):
            env |= self.get("ConfigMap", source["configMapRef"]["name"])["data"]
        return env

    def pods_selected(self, selector: dict[str, str]) -> list[dict[str, Any]]:
        """Deployments whose pod template carries every label of `selector`."""
        return [d for d in self.of_kind("Deployment")
                if selector.items() <= d["spec"]["template"]["metadata"]["labels"].items()]

    def service_backend(self, service: dict[str, Any], port: int) -> tuple[dict[str, Any], dict[str, Any]]:
        """(the one Deployment behind `service`, its containerPort entry that the Service's `port` reaches)."""
        (deployment,) = self.pods_selected(service["spec"]["selector"])
        (service_port,) = [p for p in service["spec"]["ports"] if p["port"] == port]
        return deployment, container_port(deployment, service_port["targetPort"])


def container_port(deployment: dict[str, Any], name_or_number: str | int) -> dict[str, Any]:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    (port,) = [p for p in container["ports"] if name_or_number in (p["name"], p["containerPort"])]
    return port


def render(values: dict[str, Any] | None = None) -> RenderedChart:
    """Validate `values` against values.schema.json (as `helm install` does), render, parse every object."""
    with helm.Chart.load(CHART) as chart:
        chart.validate_schema(values)
        files = chart.render(values, name=RELEASE, namespace=NAMESPACE, is_install=True)
    manifests = []
    for path, text in sorted(files.items()):
        if path.endswith("NOTES.txt"):
            continue
        manifests += [doc for doc in yaml.load_all(text, Loader=_UniqueKeyLoader) if doc]
    notes = next((text for path, text in files.items() if path.endswith("NOTES.txt")), "")
    return RenderedChart(values or {}, manifests, notes)
