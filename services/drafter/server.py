"""The drafter process: one proposer behind the Drafter gRPC service.

`serve` is what tests and embedders use (any Proposer, any port, returns the bound port); `main` is the
`specserve drafter` command, which builds the proposer from flags and runs until SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import Sequence

from services.common.drafter_wire import DrafterDescription, drafter_pb2, drafter_pb2_grpc
from services.common.grpc_server import GrpcServer, install_sigterm_handler, start_grpc_server
from services.common.proposer import Proposer
from services.drafter.servicer import DrafterServicer

SERVICE_NAME = drafter_pb2.DESCRIPTOR.services_by_name["Drafter"].full_name  # "specserve.v1.Drafter"


async def serve(
    proposer: Proposer,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    num_speculative_tokens: int = 5,
    vocab_size: int = 0,
    tokenizer_fingerprint: str = "",
    needs_hidden_states: bool = False,
) -> tuple[GrpcServer, int]:
    """Start serving `proposer`; returns the running server and its bound port (a free one for port 0)."""
    description = DrafterDescription(
        method=proposer.method,
        vocab_size=vocab_size,
        tokenizer_fingerprint=tokenizer_fingerprint,
        needs_hidden_states=needs_hidden_states,
        max_speculative_tokens=num_speculative_tokens,
    )
    servicer = DrafterServicer(proposer, description)
    server = await start_grpc_server(
        lambda s: drafter_pb2_grpc.add_DrafterServicer_to_server(servicer, s), [SERVICE_NAME], host, port
    )
    return server, server.port


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specserve drafter", description="Serve one proposer over gRPC.")
    add_drafter_flags(parser)
    return parser


def add_drafter_flags(parser: argparse.ArgumentParser) -> None:
    """The `specserve drafter` flags, for services/cli.py to reuse on its subcommand parser."""
    parser.add_argument("--method", default="ngram", choices=["ngram"])
    parser.add_argument("--num-speculative-tokens", type=int, default=5, help="largest K served per step")
    parser.add_argument("--prompt-lookup-min", type=int, default=1)
    parser.add_argument("--prompt-lookup-max", type=int, default=4)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=50061, help="0 picks a free port")
    parser.add_argument(
        "--drain-seconds",
        type=float,
        default=0.0,
        help="on SIGTERM, report NOT_SERVING this long before refusing new streams",
    )
    parser.add_argument("--grace-seconds", type=float, default=5.0, help="time for in-flight streams to end")


def build_proposer(args: argparse.Namespace) -> Proposer:
    from services.drafter.ngram import NgramProposer, NgramSettings

    return NgramProposer(NgramSettings(args.prompt_lookup_min, args.prompt_lookup_max))


async def run(args: argparse.Namespace) -> int:
    server, port = await serve(
        build_proposer(args), args.host, args.port, num_speculative_tokens=args.num_speculative_tokens
    )
    install_sigterm_handler(lambda: server.graceful_stop(args.drain_seconds, args.grace_seconds))
    print(f"drafter ({args.method}) listening on {args.host}:{port}", flush=True)
    await server.wait()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return asyncio.run(run(build_parser().parse_args(argv)))


if __name__ == "__main__":
    raise SystemExit(main())
