"""TLS for the gRPC links (gateway → verifier → drafters): credentials from PEM files named in settings.

A server gets TLS when both a certificate chain and its key are configured; a client when it has a root
certificate to check the server against. Files are read once at start-up, so a missing or unreadable file fails
there, with the setting's path in the message, rather than on the first request.
"""

from __future__ import annotations

from pathlib import Path

import grpc
from pydantic import model_validator
from pydantic_settings import BaseSettings

from services.common.grpc_link_policy import DEFAULT_LINK_POLICY, LinkPolicy, with_options


def _read(path: str | Path, what: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as error:
        raise ValueError(f"cannot read the TLS {what} {str(path)!r}: {error.strerror or error}") from error


def server_credentials(cert_file: str | Path | None, key_file: str | Path | None) -> grpc.ServerCredentials | None:
    """Server-side TLS from a PEM certificate chain and its private key; None (plaintext) when neither is set."""
    if not cert_file and not key_file:
        return None
    if not (cert_file and key_file):
        raise ValueError("TLS needs both a certificate file and a key file (or neither)")
    return grpc.ssl_server_credentials([(_read(key_file, "key file"), _read(cert_file, "certificate file"))])


def channel_credentials(root_cert_file: str | Path | None) -> grpc.ChannelCredentials | None:
    """Client-side TLS trusting the PEM root certificate(s) in `root_cert_file`; None: plaintext."""
    if not root_cert_file:
        return None
    return grpc.ssl_channel_credentials(root_certificates=_read(root_cert_file, "root certificate"))


def open_channel(
    target: str,
    credentials: grpc.ChannelCredentials | None,
    options: list[tuple[str, int | str]],
    link_policy: LinkPolicy = DEFAULT_LINK_POLICY,
) -> grpc.aio.Channel:
    """A grpc.aio channel, secure when `credentials` is given, pinging and reconnecting by the project's link
    policy (the servers are started with the matching one); `options` add to or override it."""
    options = with_options(link_policy.client_options(), options)
    if credentials is None:
        return grpc.aio.insecure_channel(target, options=options)
    return grpc.aio.secure_channel(target, credentials, options=options)


class TlsServerSettings(BaseSettings):
    """The certificate settings of a gRPC server, shared by the services' settings classes (each adds its own
    env prefix): both files, or neither for plaintext."""

    tls_cert_file: str | None = None  # server certificate chain (PEM)
    tls_key_file: str | None = None  # its private key (PEM)

    @model_validator(mode="after")
    def _tls_pair(self) -> TlsServerSettings:
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("TLS needs both tls_cert_file and tls_key_file (or neither)")
        return self

    @property
    def tls_enabled(self) -> bool:
        return bool(self.tls_cert_file and self.tls_key_file)

    def server_credentials(self) -> grpc.ServerCredentials | None:
        return server_credentials(self.tls_cert_file, self.tls_key_file)
