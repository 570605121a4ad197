"""What each rendered pod's process would be configured with: its container's args parsed by the service's own
command-line parser over the environment its ConfigMaps and env give it, as the real process reads them. So the
wiring tests check the settings the services really end up with, not strings the chart happens to print."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from services.drafter.server import add_drafter_flags
from services.drafter.server import settings_from_args as drafter_settings_from_args
from services.drafter.settings import DrafterSettings
from services.gateway.main import parse_args as gateway_parse_args
from services.gateway.settings import GatewaySettings
from services.verifier.main import add_verifier_flags
from services.verifier.main import settings_from_args as verifier_settings_from_args
from services.verifier.settings import VerifierSettings
from tests.deploy.rendered_chart import RenderedChart


@contextmanager
def _environment(env: dict[str, str]) -> Iterator[None]:
    """os.environ with every SPECSERVE_* variable replaced by `env`'s, restored afterwards."""
    saved = dict(os.environ)
    for name in [name for name in os.environ if name.startswith("SPECSERVE_")]:
        del os.environ[name]
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def container_env(chart: RenderedChart, deployment: dict[str, Any]) -> dict[str, str]:
    """ConfigMap variables, then the container's literal `env` entries (secret references are not values)."""
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    literal = {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}
    return chart.config_env(deployment) | literal


def _parse(add_flags: Callable[[argparse.ArgumentParser], None], to_settings, args: list[str]):
    parser = argparse.ArgumentParser()
    add_flags(parser)
    return to_settings(parser.parse_args(args))


def process_settings(chart: RenderedChart, deployment: dict[str, Any]):
    """The settings object the Deployment's container would start with."""
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    command, args = container["command"], container.get("args") or []
    with _environment(container_env(chart, deployment)):
        if command == ["specserve", "gateway"]:
            return gateway_parse_args(args)
        if command == ["specserve", "verifier"]:
            return _parse(add_verifier_flags, verifier_settings_from_args, args)
        if command == ["specserve", "drafter"]:
            return _parse(add_drafter_flags, drafter_settings_from_args, args)
    raise AssertionError(f"unknown command {command}")


SETTINGS_CLASSES = {"GATEWAY": GatewaySettings, "VERIFIER": VerifierSettings, "DRAFTER": DrafterSettings}
