"""`python -m services.common.health_probe [host:port]`: exit 0 when a gRPC server's standard health service
answers SERVING, 1 otherwise. The container images' HEALTHCHECK for the verifier and the drafters.

Why not grpc_health_probe: that is a separate Go binary an image would download from outside a package
registry; this probe is the same check (grpc.health.v1.Health/Check, overall status: service "") with what every
image already has. A server that drains on SIGTERM turns NOT_SERVING first, so the probe fails from then on.
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.tls import channel_credentials


def check(address: str, *, root_cert_file: str | None = None, timeout_s: float = 3.0) -> str:
    """The status name the server at `address` reports (SERVING, NOT_SERVING, ...)."""
    credentials = channel_credentials(root_cert_file)
    channel = (
        grpc.insecure_channel(address) if credentials is None else grpc.secure_channel(address, credentials)
    )
    with channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.common.health_probe", description=__doc__.split("\n")[0])
    parser.add_argument("address", nargs="?", default="127.0.0.1:50051", help="host:port (default %(default)s)")
    parser.add_argument("--tls-root-cert", default=None, help="PEM root certificate, for a server that serves TLS")
    parser.add_argument("--timeout-s", type=float, default=3.0)
    args = parser.parse_args(argv)
    try:
        status = check(args.address, root_cert_file=args.tls_root_cert, timeout_s=args.timeout_s)
    except grpc.RpcError as error:
        print(f"{args.address}: {error.code().name}: {error.details()}", file=sys.stderr)
        return 1
    print(f"{args.address}: {status}")
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    raise SystemExit(main())
