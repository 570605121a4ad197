"""The Helm chart charts/specserve, rendered by real Helm for the default values and each file in its ci/ folder:
lint-clean, every object valid for the Kubernetes API models, and wired so the processes find each other
(verifier -> every drafter's Service, gateway -> the headless verifier Service, Prometheus -> each metrics port,
probes -> the ports the services listen on), with the settings the services themselves parse from the pods."""

from __future__ import annotations

import functools
import json

import helm_python as helm
import kubernetes.client
import pytest

from services.gateway.verifier_target import parse_verifier_target
from tests.deploy.chart_processes import SETTINGS_CLASSES, container_env, process_settings
from tests.deploy.rendered_chart import (
    CHART,
    NAMESPACE,
    RenderedChart,
    container_port,
    model_class,
    render,
    values_file,
)

VALUES_FILES = sorted(path.name for path in (CHART / "ci").glob("*.yaml"))
ALL_VALUES = [None, *VALUES_FILES]  # None: the chart's defaults


@functools.cache
def rendered(name: str | None) -> RenderedChart:
    return render(values_file(name) if name else None)


def _deployment(chart: RenderedChart, component: str, drafter: str | None = None) -> dict:
    labels = {"app.kubernetes.io/component": component}
    if drafter:
        labels["specserve.io/drafter"] = drafter.replace("_", "-")
    (deployment,) = chart.pods_selected(labels)
    return deployment


def _drafter_entries(chart: RenderedChart) -> list[dict]:
    return chart.values.get("drafters", [{"name": "ngram", "method": "ngram"}])


def _container(deployment: dict) -> dict:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def test_the_ci_values_files_are_the_three_scenarios():
    assert VALUES_FILES == ["cpu-minimal-values.yaml", "gpu-two-drafters-values.yaml", "monitoring-values.yaml"]


@pytest.mark.parametrize("values", ALL_VALUES)
def test_lint_is_clean(values):
    report = helm.lint(CHART, values_file(values) if values else None, strict=True)
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []  # only "icon is recommended" (info)


@pytest.mark.parametrize("values", ALL_VALUES)
def test_every_object_is_a_valid_kubernetes_object(values):
    """Each manifest deserializes into its kubernetes client model, which refuses unknown fields and wrong
    types (a quantity given as a number, a port as a string)."""
    chart = rendered(values)
    kinds = set()
    for manifest in chart.manifests:
        kinds.add(manifest["kind"])
        if manifest["kind"] == "ServiceMonitor":  # a CRD: no client model; its fields are checked below
            kubernetes.client.V1ObjectMeta.model_validate(manifest["metadata"])
            continue
        model_class(manifest).model_validate(manifest)
        assert manifest["metadata"]["name"].startswith("rel-specserve")
    assert {"Deployment", "Service", "ConfigMap", "PodDisruptionBudget"} <= kinds


@pytest.mark.parametrize("values", ALL_VALUES)
def test_the_verifier_reaches_every_drafter_through_its_service(values):
    chart = rendered(values)
    verifier = process_settings(chart, _deployment(chart, "verifier"))
    entries = _drafter_entries(chart)
    assert list(verifier.drafter_targets) == [entry["name"] for entry in entries]
    for entry in entries:
        host, _, port = verifier.drafter_targets[entry["name"]].rpartition(":")
        service = chart.get("Service", host)
        deployment, reached = chart.service_backend(service, int(port))
        assert deployment is _deployment(chart, "drafter", entry["name"])
        drafter = process_settings(chart, deployment)
        assert reached["name"] == "grpc" and reached["containerPort"] == drafter.port
        assert drafter.host == "0.0.0.0"
        assert drafter.speculation.method == entry["method"]
        if "numSpeculativeTokens" in entry:
            assert drafter.speculation.num_speculative_tokens == entry["numSpeculativeTokens"]
        if "model" in entry:
            assert drafter.speculation.model == entry["model"]


@pytest.mark.parametrize("values", ALL_VALUES)
def test_the_gateway_balances_over_the_headless_verifier_service(values):
    chart = rendered(values)
    gateway = process_settings(chart, _deployment(chart, "gateway"))
    verifier_deployment = _deployment(chart, "verifier")
    verifier = process_settings(chart, verifier_deployment)
    target = parse_verifier_target(gateway.verifier).target
    assert target.startswith("dns:///")
    host, _, port = target.removeprefix("dns:///").rpartition(":")
    service_name, namespace = host.split(".")[:2]
    assert namespace == NAMESPACE and host.endswith(".svc.cluster.local")
    service = chart.get("Service", service_name)
    assert service["spec"]["clusterIP"] == "None"  # DNS answers every ready pod, not one virtual IP
    deployment, reached = chart.service_backend(service, int(port))
    assert deployment is verifier_deployment
    assert reached["name"] == "grpc" and reached["containerPort"] == verifier.port
    assert verifier.host == gateway.host == "0.0.0.0"
    assert container_port(_deployment(chart, "gateway"), "http")["containerPort"] == gateway.port
    assert gateway.model == verifier.model == chart.values.get("model", "smollm2-135m-instruct")


@pytest.mark.parametrize("values", ALL_VALUES)
def test_the_gateways_requests_share_a_call_per_verifier_replica(values):
    chart = rendered(values)
    gateway = process_settings(chart, _deployment(chart, "gateway"))
    replicas = _deployment(chart, "verifier")["spec"]["replicas"]
    assert gateway.verifier_shared_stream and gateway.verifier_shared_stream_calls == max(1, replicas)


def test_gateway_settings_override_the_shared_calls():
    chart = render({"verifier": {"replicas": 3}, "gateway": {"settings": {"verifier_shared_stream": False}}})
    gateway = process_settings(chart, _deployment(chart, "gateway"))
    assert not gateway.verifier_shared_stream and gateway.verifier_shared_stream_calls == 3
    chart = render({"verifier": {"replicas": 3}, "gateway": {"settings": {"verifier_shared_stream_calls": 6}}})
    assert process_settings(chart, _deployment(chart, "gateway")).verifier_shared_stream_calls == 6
    chart = render({"verifier": {"replicas": 0}})  # scaled to zero: one call, so that the gateway still starts
    assert process_settings(chart, _deployment(chart, "gateway")).verifier_shared_stream_calls == 1


@pytest.mark.parametrize("values", ALL_VALUES)
def test_probes_ask_the_ports_the_services_listen_on(values):
    chart = rendered(values)
    for deployment in chart.of_kind("Deployment"):
        container = _container(deployment)
        probes = [container[kind] for kind in ("startupProbe", "readinessProbe", "livenessProbe")]
        settings = process_settings(chart, deployment)
        if container["command"][1] == "gateway":
            assert probes[1]["httpGet"] == {"path": "/health", "port": "http"}
            assert all(container_port(deployment, probe.get("tcpSocket", probe.get("httpGet"))["port"])
                       ["containerPort"] == settings.port for probe in probes)
        else:  # grpc.health.v1 on the service's own port
            assert all(probe["grpc"]["port"] == settings.port for probe in probes)
            assert container_port(deployment, "grpc")["containerPort"] == settings.port
            assert container_port(deployment, "metrics")["containerPort"] == settings.metrics_port


def test_the_service_monitor_scrapes_every_service_once_on_its_metrics_port():
    chart = rendered("monitoring-values.yaml")
    (monitor,) = chart.of_kind("ServiceMonitor")
    spec = monitor["spec"]
    assert set(spec) == {"namespaceSelector", "selector", "endpoints"}
    assert spec["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    selected = [s for s in chart.of_kind("Service")
                if spec["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()]
    scraped = {}  # Deployment name -> the containerPorts scraped in it
    for service in selected:
        for endpoint in spec["endpoints"]:
            assert set(endpoint) <= {"port", "path", "interval", "scrapeTimeout"}
            ports = [p for p in service["spec"]["ports"] if p["name"] == endpoint["port"]]
            for port in ports:
                deployment, reached = chart.service_backend(service, port["port"])
                assert endpoint["path"] == "/metrics"
                scraped.setdefault(deployment["metadata"]["name"], []).append(reached["containerPort"])
    deployments = chart.of_kind("Deployment")
    assert set(scraped) == {d["metadata"]["name"] for d in deployments}
    for deployment in deployments:
        settings = process_settings(chart, deployment)
        metrics_port = getattr(settings, "metrics_port", None) or settings.port  # the gateway: its HTTP port
        assert scraped[deployment["metadata"]["name"]] == [metrics_port]  # once, where /metrics is served
    assert rendered(None).of_kind("ServiceMonitor") == []  # off unless asked for (it needs the operator's CRDs)


def test_accelerators_and_placement_come_from_values():
    gpu = rendered("gpu-two-drafters-values.yaml")
    verifier = _deployment(gpu, "verifier")
    assert _container(verifier)["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert verifier["spec"]["replicas"] == 2
    assert verifier["spec"]["template"]["spec"]["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert process_settings(gpu, verifier).device == "cuda"
    draft_model = _deployment(gpu, "drafter", "draft_model")
    assert _container(draft_model)["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert _container(draft_model)["image"] == "specserve-drafter-model:0.1.0"
    assert process_settings(gpu, draft_model).speculation.draft_device == "cuda"
    suffix = _deployment(gpu, "drafter", "suffix")
    assert "nvidia.com/gpu" not in _container(suffix)["resources"]["limits"]
    assert _container(suffix)["image"] == "specserve-drafter:0.1.0"
    ascend = _deployment(rendered("monitoring-values.yaml"), "verifier")
    assert _container(ascend)["resources"]["limits"]["huawei.com/Ascend910"] == "1"


def test_each_drafter_scales_on_its_own():
    chart = rendered("gpu-two-drafters-values.yaml")
    (hpa,) = chart.of_kind("HorizontalPodAutoscaler")
    draft_model = _deployment(chart, "drafter", "draft_model")
    assert hpa["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                             "name": draft_model["metadata"]["name"]}
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (1, 2)
    assert "replicas" not in draft_model["spec"]  # the HPA owns it
    assert _deployment(chart, "drafter", "suffix")["spec"]["replicas"] == 2
    for pdb in chart.of_kind("PodDisruptionBudget"):
        assert len(chart.pods_selected(pdb["spec"]["selector"]["matchLabels"])) == 1
    assert len(chart.of_kind("PodDisruptionBudget")) == len(chart.of_kind("Deployment"))


def _mounts_models(deployment: dict) -> bool:
    return any(m["name"] == "models" for m in _container(deployment).get("volumeMounts", []))


def test_model_storage_on_a_volume_claim():
    chart = rendered("gpu-two-drafters-values.yaml")
    (claim,) = chart.of_kind("PersistentVolumeClaim")
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    for deployment in (_deployment(chart, "gateway"), _deployment(chart, "verifier"),
                       _deployment(chart, "drafter", "draft_model")):
        (volume,) = deployment["spec"]["template"]["spec"]["volumes"]
        assert volume["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
        (mount,) = _container(deployment)["volumeMounts"]
        assert container_env(chart, deployment)["SPECSERVE_CACHE_DIR"] == mount["mountPath"] == "/models"
    assert not _mounts_models(_deployment(chart, "drafter", "suffix"))  # no model, no volume


def test_model_storage_from_an_image_by_init_container_or_image_volume():
    chart = rendered("monitoring-values.yaml")
    verifier = _deployment(chart, "verifier")
    pod = verifier["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    assert init["image"] == "registry.example.com/models/qwen2.5-7b-instruct:1"
    assert init["volumeMounts"] == [{"name": "models", "mountPath": "/specserve-models"}]
    assert init["command"][-1] == "cp -a /models/. /specserve-models/"
    assert "emptyDir" in pod["volumes"][0] and _mounts_models(verifier)
    assert "initContainers" not in _deployment(chart, "drafter", "ngram")["spec"]["template"]["spec"]

    volume_chart = render({"modelStorage": {"type": "image", "image": {
        "repository": "models/smollm2", "tag": "v1", "sourcePath": "/data/models", "method": "volume"}}})
    verifier = _deployment(volume_chart, "verifier")
    model_class(verifier).model_validate(verifier)
    (volume,) = verifier["spec"]["template"]["spec"]["volumes"]
    assert volume["image"]["reference"] == "models/smollm2:v1"
    (mount,) = _container(verifier)["volumeMounts"]
    assert mount == {"name": "models", "mountPath": "/models", "subPath": "data/models", "readOnly": True}


def test_the_api_key_comes_from_a_secret():
    chart = rendered("gpu-two-drafters-values.yaml")
    (secret,) = chart.of_kind("Secret")
    (env,) = [e for e in _container(_deployment(chart, "gateway"))["env"] if e["name"] == "SPECSERVE_API_KEY"]
    assert env["valueFrom"]["secretKeyRef"] == {"name": secret["metadata"]["name"], "key": "api-key"}
    assert "api-key" in secret["data"]

    existing = rendered("monitoring-values.yaml")
    assert existing.of_kind("Secret") == []
    (env,) = [e for e in _container(_deployment(existing, "gateway"))["env"] if e["name"] == "SPECSERVE_API_KEY"]
    assert env["valueFrom"]["secretKeyRef"] == {"name": "specserve-api-key", "key": "token"}

    open_chart = rendered("cpu-minimal-values.yaml")
    assert all(e["name"] != "SPECSERVE_API_KEY" for e in _container(_deployment(open_chart, "gateway"))["env"])
    assert "WARNING: no API key" in open_chart.notes


@pytest.mark.parametrize(("served", "curled"), [("", "smollm2-135m-instruct"), ("coder", "coder"),
                                               ("coder, org/coder", "coder")])
def test_the_notes_curl_the_name_responses_give(served, curled):
    """With several served names (comma-separated, as the gateway reads them) the notes' curl sends the first."""
    notes = render({"servedModelName": served}).notes
    assert f'"model": "{curled}"' in notes


def test_the_dashboard_configmap_is_labelled_for_grafanas_sidecar():
    chart = rendered("monitoring-values.yaml")
    (dashboard,) = [c for c in chart.of_kind("ConfigMap") if c["metadata"]["name"].endswith("-dashboard")]
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert dashboard["metadata"]["labels"]["team"] == "inference"
    assert dashboard["metadata"]["annotations"] == {"grafana_folder": "specserve"}
    source = CHART / "dashboards" / "specserve.json"
    expected = source.read_text() if source.exists() else ""  # the dashboard file is its own piece of work
    assert dashboard["data"]["specserve.json"] == expected
    if expected:
        assert json.loads(dashboard["data"]["specserve.json"])["panels"]
    assert not [c for c in rendered("cpu-minimal-values.yaml").of_kind("ConfigMap")
                if c["metadata"]["name"].endswith("-dashboard")]


def test_settings_values_reach_the_processes():
    chart = rendered("gpu-two-drafters-values.yaml")
    verifier = process_settings(chart, _deployment(chart, "verifier"))
    assert (verifier.draft_timeout_s, verifier.max_num_seqs, verifier.dtype) == (0.3, 128, "bfloat16")
    assert verifier.kv_cache.memory_bytes == 40 << 30  # kvCacheMemoryBytes: 40GiB
    assert verifier.speculation.method == "suffix" and verifier.drain_s == 5
    suffix = process_settings(chart, _deployment(chart, "drafter", "suffix"))
    assert suffix.speculation.options.suffix_decoding_max_tree_depth == 32
    draft_model = process_settings(chart, _deployment(chart, "drafter", "draft_model"))
    assert (draft_model.speculation.draft_max_num_seqs, draft_model.speculation.num_speculative_tokens) == (32, 4)
    big = render({"verifier": {"settings": {"max_waiting_requests": 2_000_000, "adaptive_speculation": False}}})
    verifier = process_settings(big, _deployment(big, "verifier"))
    assert (verifier.max_waiting_requests, verifier.adaptive_speculation) == (2_000_000, False)
    eagle3 = render({"verifier": {"settings": {"hidden_layers": [2, 15, 27]}}})  # a list reaches it as JSON
    assert process_settings(eagle3, _deployment(eagle3, "verifier")).hidden_layers == [2, 15, 27]


def test_every_service_setting_is_set_by_the_chart_or_allowed_in_values():
    """A setting added to a service must be reachable from values (or set by the chart): this fails naming it."""
    schema = json.loads((CHART / "values.schema.json").read_text())["properties"]
    allowed = {
        "GATEWAY": schema["gateway"]["properties"]["settings"]["properties"],
        "VERIFIER": schema["verifier"]["properties"]["settings"]["properties"],
        "DRAFTER": schema["drafters"]["items"]["properties"]["settings"]["properties"],
    }
    set_by_chart = {prefix: set() for prefix in SETTINGS_CLASSES}  # over every values file
    config_maps = [config_map for values in ALL_VALUES for config_map in rendered(values).of_kind("ConfigMap")]
    for config_map in config_maps:
        for name in config_map.get("data", {}):
            prefix, _, field = name.removeprefix("SPECSERVE_").partition("_")
            if prefix in set_by_chart:
                set_by_chart[prefix].add(field.lower())
    set_by_chart["VERIFIER"].add("drafters")  # --drafter, one per drafter Service
    set_by_chart["GATEWAY"].add("api_key")  # SPECSERVE_API_KEY from the Secret
    # HTTPS on the gateway itself is for `specserve serve` on a host; in a cluster TLS ends at the Ingress, and the
    # chart's probes, ServiceMonitor and NOTES speak plain HTTP to the gateway
    allowed["GATEWAY"] = {*allowed["GATEWAY"], "ssl_keyfile", "ssl_certfile"}
    for prefix, settings_class in SETTINGS_CLASSES.items():
        missing = set(settings_class.model_fields) - set_by_chart[prefix] - set(allowed[prefix])
        assert not missing, f"{settings_class.__name__} fields the chart cannot set: {sorted(missing)}"
        assert set_by_chart[prefix] <= set(settings_class.model_fields)  # nothing the service would ignore


@pytest.mark.parametrize("values, where", [
    ({"verifer": {"replicas": 2}}, "verifer"),
    ({"verifier": {"replica": 2}}, "replica"),
    ({"verifier": {"settings": {"draft_timout_s": 1}}}, "draft_timout_s"),
    ({"drafters": [{"name": "ngram", "method": "ngram", "replica": 2}]}, "replica"),
    ({"drafters": [{"name": "ngram"}]}, "method"),
    ({"drafters": [{"name": "none", "method": "ngram"}]}, "name"),
    ({"drafters": [{"name": "Draft.Model", "method": "draft_model"}]}, "name"),
    ({"modelStorage": {"type": "s3"}}, "type"),
    ({"gateway": {"autoscaling": {"enable": True}}}, "enable"),
    ({"metrics": {"serviceMonitor": {"enabled": "yes"}}}, "enabled"),
])
def test_the_schema_rejects_typos_and_bad_values(values, where):
    with helm.Chart.load(CHART) as chart, pytest.raises(helm.HelmValuesError, match=where):
        chart.validate_schema(values)
