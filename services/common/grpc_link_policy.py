"""One link policy (keepalive pings, reconnect backoff) for every gRPC client and server pair of the project
(gateway -> verifier -> drafters).

Keepalive, why one policy: gRPC servers by default refuse pings on a connection without calls and answer a client that pings
more often than every 5 minutes with GOAWAY "too_many_pings". A client that pings every 30 s while idle (so it
notices a dead peer behind a NAT or load balancer) is then disconnected after a few idle minutes, and its next
call fails. Deriving both sides' options from one `LinkPolicy` keeps them consistent: the server permits
pings without calls and accepts them at half the client's interval, so jitter never counts as a strike.

Message size: gRPC refuses a received message over 4 MiB by default. An EAGLE drafter's first step of a request
carries the target's hidden states of its whole prompt: 4 requests of 1,800 tokens with SmolLM2's 576-wide states
made a 6.2 MB step, which the drafter refused, breaking the stream for every request (issue 29). Both sides allow
`max_message_bytes`; the verifier also spreads a large backlog of states over several steps (remote_proposer.py),
so a step stays far below it.

Reconnect backoff: gRPC's default (1 s, growing 1.6x up to 120 s) means a client whose peer was away for a minute
keeps failing fast for up to two more after the peer is back. Services here restart in seconds (specserve serve
supervises them), so clients retry at most every `reconnect_max_ms`.

`open_channel` (services.common.tls) and `start_grpc_server` (services.common.grpc_server) apply the default
policy, so every link gets it without each caller repeating options.
"""

from __future__ import annotations

from dataclasses import dataclass

GrpcOptions = list[tuple[str, int | str]]


@dataclass(frozen=True)
class LinkPolicy:
    """Client pings every `ping_interval_ms` (also while idle) and gives a peer `ping_timeout_ms` to answer;
    servers allow pings that often and ping idle clients themselves at the same interval. A client that lost its
    peer tries to reconnect after `reconnect_initial_ms`, backing off to at most `reconnect_max_ms`."""

    ping_interval_ms: int = 30_000
    ping_timeout_ms: int = 10_000
    reconnect_initial_ms: int = 100
    reconnect_max_ms: int = 2_000
    max_message_bytes: int = 256 * 1024 * 1024

    def message_options(self) -> GrpcOptions:
        return [("grpc.max_receive_message_length", self.max_message_bytes),
                ("grpc.max_send_message_length", self.max_message_bytes)]

    def client_options(self) -> GrpcOptions:
        return [
            *self.message_options(),
            ("grpc.keepalive_time_ms", self.ping_interval_ms),
            ("grpc.keepalive_timeout_ms", self.ping_timeout_ms),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),  # idle pings are not limited in number
            ("grpc.initial_reconnect_backoff_ms", self.reconnect_initial_ms),
            ("grpc.min_reconnect_backoff_ms", self.reconnect_initial_ms),
            ("grpc.max_reconnect_backoff_ms", self.reconnect_max_ms),
        ]

    def server_options(self) -> GrpcOptions:
        return [
            *self.message_options(),
            ("grpc.keepalive_time_ms", self.ping_interval_ms),
            ("grpc.keepalive_timeout_ms", self.ping_timeout_ms),
            ("grpc.keepalive_permit_without_calls", 1),
            # accept client pings up to twice as often as the policy sends them (timer jitter, reconnects)
            ("grpc.http2.min_recv_ping_interval_without_data_ms", self.ping_interval_ms // 2),
            ("grpc.http2.min_ping_interval_without_data_ms", self.ping_interval_ms // 2),
            ("grpc.http2.max_ping_strikes", 2),
        ]


DEFAULT_LINK_POLICY = LinkPolicy()


def with_options(base: GrpcOptions, extra: GrpcOptions) -> GrpcOptions:
    """`base` with the keys of `extra` replaced (gRPC takes the first of duplicate keys inconsistently)."""
    keys = {key for key, _ in extra}
    return [item for item in base if item[0] not in keys] + list(extra)
