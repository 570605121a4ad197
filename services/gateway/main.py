"""`specserve gateway`: run the OpenAI-compatible HTTP gateway in front of a verifier."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from services.gateway.settings import (
    GatewaySettings,
    add_cors_flags,
    add_generation_config_flag,
    add_https_flags,
    add_logging_flags,
    add_root_path_flag,
    check_request_logging,
)
from services.gateway.torch_free import hide_torch, quiet_torch_absence


def parse_args(argv: list[str] | None) -> GatewaySettings:
    parser = argparse.ArgumentParser(prog="specserve gateway", description=__doc__)
    parser.add_argument("--host", help="bind address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, help="HTTP port (default 8000)")
    parser.add_argument("--verifier", help="verifier gRPC address host:port (default 127.0.0.1:50051); several: "
                        "host:port,host:port or dns:///name:port (every address of a name, e.g. a headless "
                        "Service), balanced round robin over the healthy ones")
    parser.add_argument("--model", help="model spec for the tokenizer (default: the verifier's model id)")
    parser.add_argument("--trust-remote-code", action="store_true", default=None,
                        help="vLLM's flag: load a tokenizer that ships Python code, running it (default off)")
    add_generation_config_flag(parser)
    parser.add_argument("--served-model-name", nargs="+", metavar="NAME",
                        help="the names clients send as 'model'; responses give the first (vLLM's flag; default: the "
                        "verifier's model id)")
    parser.add_argument("--chat-template", help="a Jinja chat template, or the path of a file holding one, for every "
                        "chat request in place of the model's own (vLLM's flag)")
    parser.add_argument("--api-key", help="require 'Authorization: Bearer <key>' on /v1 (or SPECSERVE_API_KEY)")
    add_cors_flags(parser)
    add_logging_flags(parser)
    add_https_flags(parser)
    add_root_path_flag(parser)
    parser.add_argument("--grpc-root-cert", help="PEM root certificate: use TLS to the verifier")
    parser.add_argument("--tool-call-parser", help="how the model writes tool calls: hermes (default; Qwen2.5, "
                                                   "Hermes)")
    parser.add_argument("--verifier-shared-stream", action="store_true", default=None,
                        help="requests share GenerateMany calls, so each engine step's outputs come as one message, "
                             "not one per request (fewer host costs on the verifier's loop at high concurrency)")
    parser.add_argument("--verifier-shared-stream-calls", type=int, metavar="N",
                        help="with --verifier-shared-stream: how many calls, one per verifier (default: one per "
                             "address of a --verifier list, else 1)")
    parser.add_argument("--verifier-shared-stream-max-age-s", type=float, metavar="S",
                        help="with --verifier-shared-stream: a call takes new requests for S seconds, then a new "
                             "one replaces it, so calls follow verifiers that join or restart (default 60)")
    args = parser.parse_args(argv)
    try:
        check_request_logging(args)
    except ValueError as error:
        parser.error(str(error))
    args.disable_log_requests = None  # what it turns off is off by default (add_logging_flags)
    given = {k: v for k, v in vars(args).items() if v is not None}
    return GatewaySettings(**given)  # flags override SPECSERVE_GATEWAY_* environment values


def main(argv: list[str] | None = None) -> int:
    settings = parse_args(argv)
    if not settings.trust_remote_code:  # a tokenizer's own code may import torch: then torch stays
        hide_torch()  # before transformers is imported: the gateway itself never needs torch (torch_free.py)
    quiet_torch_absence()  # in its image too, which has no torch at all
    import uvicorn

    from services.gateway.app import create_app

    tokenizer = None
    if settings.model:  # known now: a model that cannot be found or fetched fails the start (cli.py: exit 1)
        from services.gateway.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(settings.model, trust_remote_code=settings.trust_remote_code)
    app = create_app(settings, tokenizer=tokenizer)
    base = f"{settings.scheme}://{settings.host}:{settings.port}"
    print(f"specserve gateway -> verifier {settings.verifier}", file=sys.stderr)
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/models", "/health", "/metrics",
                 "/tokenize", "/detokenize"):
        print(f"  {base}{path}", file=sys.stderr)
    uvicorn.run(app, **server_options(settings))
    return 0


def server_options(settings: GatewaySettings) -> dict[str, Any]:
    """uvicorn's options for the gateway's settings."""
    return {"host": settings.host, "port": settings.port, "log_level": settings.uvicorn_log_level,
            "access_log": not settings.disable_uvicorn_access_log, "ssl_keyfile": settings.ssl_keyfile,
            "ssl_certfile": settings.ssl_certfile, "root_path": settings.root_path}


if __name__ == "__main__":
    raise SystemExit(main())
