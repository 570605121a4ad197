"""`--verifier` values -> gRPC channel targets: one address as it is, a list as a fixed address set, every target
balanced round robin over the verifiers that report SERVING."""

from __future__ import annotations

import json

import pytest

from services.gateway.verifier_target import VERIFIER_HEALTH_SERVICE, parse_verifier_target


def _service_config(target) -> dict:
    return json.loads(dict(target.channel_options())["grpc.service_config"])


@pytest.mark.parametrize("spec", ["127.0.0.1:50051", "verifier:50051", "dns:///verifier-headless.ns.svc:50051",
                                  "unix:///run/verifier.sock"])
def test_a_single_address_or_a_grpc_target_is_used_as_it_is(spec):
    target = parse_verifier_target(spec)
    assert target.target == spec and target.authority is None


def test_a_list_becomes_a_fixed_address_set_with_names_resolved():
    target = parse_verifier_target("127.0.0.1:50051, localhost:50052")
    assert target.target == "ipv4:127.0.0.1:50051,127.0.0.1:50052"
    assert target.authority == "127.0.0.1"


def test_an_ipv6_list():
    assert parse_verifier_target("[::1]:50051,[::1]:50052").target == "ipv6:[::1]:50051,[::1]:50052"


def test_every_target_balances_round_robin_over_healthy_verifiers():
    config = _service_config(parse_verifier_target("verifier:50051"))
    assert config["loadBalancingConfig"] == [{"round_robin": {}}]
    assert config["healthCheckConfig"] == {"serviceName": VERIFIER_HEALTH_SERVICE}
    assert VERIFIER_HEALTH_SERVICE == "specserve.v1.Verifier"


@pytest.mark.parametrize("spec, message", [
    ("127.0.0.1:50051,127.0.0.1", "host:port"),
    ("127.0.0.1:50051,[::1]:50052", "all IPv4 or all IPv6"),
    ("127.0.0.1:50051,no-such-host.invalid:1", "cannot resolve"),
])
def test_bad_lists_fail_at_start_up_with_the_reason(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_verifier_target(spec)
