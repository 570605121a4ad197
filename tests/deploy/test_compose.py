"""docker-compose.yml: valid under the compose specification, and the same topology as `specserve serve`.

No Docker engine runs here, so the compose file is checked the two ways that catch what would break it: against
the compose specification's JSON schema (tests/deploy/data/compose-spec.json, see its README), and against
`services.launcher.plan`, the services, flags and ports that `specserve serve` runs as processes and that the
end-to-end tests exercise. Hosts differ by design (127.0.0.1 there, compose service names here) and are left out
of the comparison; everything else must match, so a flag added to one and not the other fails here. The images'
entrypoints, exposed ports and health checks come from the Dockerfiles' stages, and Prometheus's scrape targets
from deploy/prometheus/prometheus.yml, so those are held to the same plan.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import jsonschema
import pytest
import yaml

from services import launcher
from services.cli import build_parser
from services.common.speculative_config import SpeculativeConfig
from tests.deploy.dockerfiles import ROOT, dockerfile_stages, entrypoint, instructions

COMPOSE = ROOT / "docker-compose.yml"
SCHEMA = Path(__file__).parent / "data" / "compose-spec.json"
PROMETHEUS = ROOT / "deploy" / "prometheus" / "prometheus.yml"
GRAFANA = ROOT / "deploy" / "grafana" / "provisioning"
ADDRESS = re.compile(r"^(?:(?P<name>[\w.-]+)=)?(?P<host>[\w.-]+):(?P<port>\d+)$")
MONITORING = {"prometheus", "grafana"}


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def stage_of(service: dict) -> list[str]:
    build = service["build"]
    return dockerfile_stages(ROOT / build["dockerfile"])[build["target"]]


def flag_pairs(argv: list[str]) -> Counter:
    """`--flag value` and bare `--flag` tokens as a multiset of (flag, value), hosts left out: `--host` is
    dropped, `name=host:port` and `host:port` keep their name and port, and a speculative config compares by
    what it parses to (launcher.plan writes its JSON more compactly)."""
    pairs: list[tuple[str, str | None]] = []
    index = 0
    while index < len(argv):
        flag = argv[index]
        assert flag.startswith("--"), f"{flag!r} in {argv}: flags only"
        value = argv[index + 1] if index + 1 < len(argv) and not argv[index + 1].startswith("--") else None
        index += 1 if value is None else 2
        if flag == "--host":
            continue
        if flag == "--speculative-config" and value is not None:
            value = json.dumps(SpeculativeConfig.parse(value).model_dump(), sort_keys=True)
        elif value is not None and (address := ADDRESS.match(value)):
            value = f"{address['name'] or ''}={address['port']}"
        pairs.append((flag, value))
    return Counter(pairs)


def flag_value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


@pytest.fixture(scope="module")
def serve_plan(compose: dict) -> dict[str, list[str]]:
    """What `specserve serve` runs for the compose file's model and speculative config: service -> the
    arguments after `python -m services.cli`, e.g. ["verifier", "--model", ...]."""
    verifier = compose["services"]["verifier"]["command"]
    argv = ["serve", "--model", flag_value(verifier, "--model"),
            "--speculative-config", flag_value(verifier, "--speculative-config")]
    children = launcher.plan(build_parser().parse_args(argv))
    prefix = ["-m", "services.cli"]
    assert all(child.argv[1:3] == prefix for child in children)
    return {child.name: child.argv[3:] for child in children}


def test_compose_file_is_valid_under_the_compose_specification(compose: dict) -> None:
    schema = json.loads(SCHEMA.read_text())
    jsonschema.Draft7Validator.check_schema(schema)
    jsonschema.validate(compose, schema, cls=jsonschema.Draft7Validator)


def test_the_schema_rejects_what_compose_would_reject(compose: dict) -> None:
    """The validation above can fail: a misspelt key and a wrong type are caught."""
    schema = json.loads(SCHEMA.read_text())
    misspelt = {**compose, "services": {**compose["services"], "gateway": {**compose["services"]["gateway"],
                                                                          "command_": ["--port", "8000"]}}}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(misspelt, schema, cls=jsonschema.Draft7Validator)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**compose, "volumes": ["models"]}, schema, cls=jsonschema.Draft7Validator)


def test_compose_runs_the_services_that_specserve_serve_runs(compose: dict, serve_plan: dict) -> None:
    assert set(compose["services"]) - MONITORING == set(serve_plan)


@pytest.mark.parametrize("name", ["drafter", "verifier", "gateway"])
def test_each_service_gets_the_flags_specserve_serve_gives_it(compose: dict, serve_plan: dict, name: str) -> None:
    service = compose["services"][name]
    image_entrypoint = entrypoint(stage_of(service))
    assert image_entrypoint[0] == "specserve", image_entrypoint  # the console script of `pip install .`
    assert image_entrypoint[1:2] == serve_plan[name][:1], "the image runs another service"
    assert flag_pairs(image_entrypoint[2:] + service["command"]) == flag_pairs(serve_plan[name][1:])


@pytest.mark.parametrize("name", ["drafter", "verifier", "gateway"])
def test_ports_are_exposed_health_checked_and_scraped(compose: dict, serve_plan: dict, name: str) -> None:
    """The serving port and the metrics port of each service: exposed by the image and by compose, the
    image's health check probes the serving port, and Prometheus scrapes the metrics port."""
    argv = serve_plan[name]
    port = flag_value(argv, "--port")
    metrics_port = flag_value(argv, "--metrics-port") if "--metrics-port" in argv else port  # gateway: /metrics
    service = compose["services"][name]
    published = {str(p).split(":")[-1] for p in service.get("ports", [])}
    assert {port, metrics_port} <= set(map(str, service.get("expose", []))) | published
    stage = stage_of(service)
    exposed = {port for line in instructions(stage, "EXPOSE") for port in line.split()}
    assert {port, metrics_port} <= exposed
    [healthcheck] = instructions(stage, "HEALTHCHECK")
    assert f"127.0.0.1:{port}" in healthcheck
    scrape = yaml.safe_load(PROMETHEUS.read_text())["scrape_configs"]
    targets = {target for job in scrape for config in job["static_configs"] for target in config["targets"]}
    assert f"{name}:{metrics_port}" in targets


def test_every_scrape_target_is_a_compose_service_port(compose: dict) -> None:
    scrape = yaml.safe_load(PROMETHEUS.read_text())["scrape_configs"]
    for job in scrape:
        for target in (t for config in job["static_configs"] for t in config["targets"]):
            host, port = target.rsplit(":", 1)
            service = compose["services"][host]
            assert port in {str(p).split(":")[-1] for p in service.get("expose", []) + service.get("ports", [])}


def test_grafana_is_provisioned_with_prometheus_and_the_chart_dashboard(compose: dict) -> None:
    grafana = compose["services"]["grafana"]
    mounts = dict(volume.split(":")[:2] for volume in grafana["volumes"] if volume.startswith("./"))
    assert mounts["./deploy/grafana/provisioning"] == "/etc/grafana/provisioning"
    [datasource] = yaml.safe_load((GRAFANA / "datasources" / "prometheus.yml").read_text())["datasources"]
    prometheus_port = compose["services"]["prometheus"]["ports"][0].split(":")[-1]
    assert datasource["url"] == f"http://prometheus:{prometheus_port}"
    [provider] = yaml.safe_load((GRAFANA / "dashboards" / "specserve.yml").read_text())["providers"]
    dashboards = next(source for source, target in mounts.items() if target == provider["options"]["path"])
    assert dashboards == "./charts/specserve/dashboards"
    assert (ROOT / dashboards / "specserve.json").is_file(), "the Helm chart's dashboard, which compose shows too"
