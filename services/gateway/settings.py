"""Gateway configuration, from flags or environment (`SPECSERVE_GATEWAY_*`, plus `SPECSERVE_API_KEY`).

The api key also answers to the project-wide `SPECSERVE_API_KEY` so one secret can be mounted for every
service; it is a SecretStr so it never shows up in logs or reprs.
"""

from __future__ import annotations

import argparse
import json
import os
import ssl
from pathlib import Path
from typing import Annotated, Literal

from pydantic import AliasChoices, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict


class GatewaySettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SPECSERVE_GATEWAY_", populate_by_name=True, extra="ignore")

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    # host:port, a comma-separated list of them, or a gRPC target such as dns:///name:port (verifier_target.py)
    verifier: str = "127.0.0.1:50051"
    # The --model spec the verifier was started with; loads the tokenizer. None: use the verifier's model_id.
    model: str | None = None
    # vLLM's --trust-remote-code: a tokenizer whose folder (or hub repo) ships Python code loads, running it
    trust_remote_code: bool = False
    # vLLM's --generation-config: "auto" (the model's generation_config.json sampling defaults apply to requests
    # that leave them out), "vllm" (OpenAI's defaults), or a folder holding a generation_config.json
    generation_config: str = "auto"
    # Names clients put in "model", as vLLM's --served-model-name: any is accepted, the first is the one responses
    # and metrics give; None: the verifier's Info.model_id. In the environment: comma-separated.
    served_model_name: Annotated[list[str] | None, NoDecode] = None
    api_key: SecretStr | None = Field(
        None,
        validation_alias=AliasChoices("api_key", "SPECSERVE_GATEWAY_API_KEY", "SPECSERVE_API_KEY"),
    )
    max_request_body_bytes: int = Field(1 << 20, ge=1)
    # Deadline of one Generate call (the whole generation) and of Info calls.
    request_timeout_s: float = Field(600.0, gt=0)
    info_timeout_s: float = Field(5.0, gt=0)
    # PEM root certificate: when set, the gRPC channel to the verifier uses TLS.
    grpc_root_cert: Path | None = None
    max_n: int = Field(16, ge=1)
    # How the model writes tool calls (services/gateway/tools/parsers.py); vLLM's --tool-call-parser.
    tool_call_parser: str = "hermes"
    # vLLM's --chat-template: a Jinja chat template, or the path of a file holding one, used for every chat request
    # in place of the model's own (read and checked at start-up: the setting then holds the template's text)
    chat_template: str | None = None
    # Requests share GenerateMany calls instead of a Generate call each (shared_stream.py): this many (None: one per
    # address of a fixed --verifier list, else one; one per verifier replica is the intent), each taking new
    # requests for verifier_shared_stream_max_age_s before a new call replaces it (shared_stream_pool.py).
    verifier_shared_stream: bool = False
    verifier_shared_stream_calls: int | None = Field(None, ge=1)
    verifier_shared_stream_max_age_s: float = Field(60.0, gt=0)
    # CORS, as vLLM's --allowed-origins, --allowed-methods, --allowed-headers and --allow-credentials: the browser
    # origins whose pages may call the API ("*": any). Unlike vLLM, none by default: a server on a workstation is
    # not callable from every web page its user opens. A JSON list as vLLM takes it, or comma-separated.
    allowed_origins: Annotated[list[str], NoDecode] = []
    allowed_methods: Annotated[list[str], NoDecode] = ["*"]
    allowed_headers: Annotated[list[str], NoDecode] = ["*"]
    allow_credentials: bool = False
    # uvicorn's logging, as vLLM's --uvicorn-log-level and --disable-uvicorn-access-log (a line per HTTP request)
    uvicorn_log_level: Literal["critical", "error", "warning", "info", "debug", "trace"] = "info"
    disable_uvicorn_access_log: bool = False
    # vLLM's --enable-log-requests and --max-log-len: a line per request with its prompt and sampling parameters
    # (request_log.py), the prompt cut to max_log_len characters and tokens (None: whole)
    enable_log_requests: bool = False
    max_log_len: int | None = Field(None, ge=0)
    # vLLM's --ssl-keyfile and --ssl-certfile: the API served over HTTPS (uvicorn's TLS), both or neither; checked
    # readable at start-up, so a wrong path fails the start naming it rather than the first client's handshake
    ssl_keyfile: Path | None = None
    ssl_certfile: Path | None = None
    # vLLM's --root-path: the path prefix a reverse proxy serves the API under and strips before forwarding (e.g.
    # /specserve); the routes stay where they are, and the URLs the server writes (its /docs page's) carry it
    root_path: str = Field("", pattern=r"^(/[^/?#\s]+)*$")

    @field_validator("ssl_keyfile", "ssl_certfile")
    @classmethod
    def _readable(cls, value: Path | None) -> Path | None:
        if value is not None and not os.access(value, os.R_OK):
            raise ValueError(f"{value} is not a readable file")
        return value

    @model_validator(mode="after")
    def _ssl_pair(self) -> GatewaySettings:
        """Both or neither, and a pair TLS can load (what uvicorn does at start, where a bad file was a traceback)."""
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("--ssl-keyfile and --ssl-certfile go together: HTTPS needs the key and its certificate")
        if self.ssl_certfile is not None:
            try:  # a password callback, so an encrypted key fails here instead of prompting on a terminal
                ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(
                    self.ssl_certfile, self.ssl_keyfile, password=lambda: b"")
            except ssl.SSLError as error:
                raise ValueError(f"--ssl-certfile {self.ssl_certfile} and --ssl-keyfile {self.ssl_keyfile} are not a "
                                 f"PEM certificate and its unencrypted private key ({error})") from error
        return self

    @property
    def scheme(self) -> str:
        return "https" if self.ssl_certfile is not None else "http"

    @field_validator("chat_template")
    @classmethod
    def _template(cls, value: str | None) -> str | None:
        from services.gateway.tokenizer import read_chat_template

        return None if value is None else read_chat_template(value)

    @field_validator("allowed_origins", "allowed_methods", "allowed_headers", mode="before")
    @classmethod
    def _cors_list(cls, value: object) -> object:
        """vLLM's JSON list (`'["https://ui.example"]'`), or comma-separated names."""
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("["):
                try:
                    return json.loads(text)
                except json.JSONDecodeError as error:
                    raise ValueError(f"not a JSON list: {error}") from error
            return [part.strip() for part in text.split(",") if part.strip()]
        return value

    @field_validator("served_model_name", mode="before")
    @classmethod
    def _names(cls, value: object) -> object:
        """One name or a comma-separated list (an environment value) as a list; an empty name is refused."""
        if isinstance(value, str):
            value = value.split(",")
        if isinstance(value, list):
            value = [name.strip() if isinstance(name, str) else name for name in value]
            if not value or "" in value:
                raise ValueError("served_model_name: every name must be non-empty")
        return value


def add_cors_flags(parser: argparse.ArgumentParser) -> None:
    """vLLM's CORS flags, declared once for `specserve gateway` and `specserve serve` (which passes them on)."""
    parser.add_argument("--allowed-origins", help="browser origins whose pages may call the API (CORS), as a JSON "
                        "list ('[\"https://ui.example\"]', '[\"*\"]': any) or comma-separated (vLLM's flag; default "
                        "none, where vLLM allows any)")
    parser.add_argument("--allowed-methods", help="with --allowed-origins: the methods allowed (default any)")
    parser.add_argument("--allowed-headers", help="with --allowed-origins: the request headers allowed (default any)")
    parser.add_argument("--allow-credentials", action="store_true", default=None,
                        help="with --allowed-origins: pages may send credentials (cookies, HTTP auth)")


def add_generation_config_flag(parser: argparse.ArgumentParser) -> None:
    """vLLM's --generation-config, declared once for `specserve gateway` and `specserve serve` (which passes it on)."""
    parser.add_argument("--generation-config", metavar="auto|vllm|FOLDER",
                        help="the sampling defaults of requests that leave them out: auto (default, as vLLM) the "
                        "model's generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty, "
                        "max_new_tokens), vllm OpenAI's, or a folder's generation_config.json")


def add_root_path_flag(parser: argparse.ArgumentParser) -> None:
    """vLLM's --root-path, declared once for `specserve gateway` and `specserve serve` (which passes it on)."""
    parser.add_argument("--root-path", metavar="/PREFIX",
                        help="the path prefix a reverse proxy serves the API under and strips before forwarding "
                        "(FastAPI's root_path: the /docs page's URLs carry it)")


def add_https_flags(parser: argparse.ArgumentParser) -> None:
    """vLLM's HTTPS flags, declared once for `specserve gateway` and `specserve serve` (which passes them on)."""
    parser.add_argument("--ssl-keyfile", help="PEM private key: serve the API over HTTPS (with --ssl-certfile)")
    parser.add_argument("--ssl-certfile", help="PEM certificate (chain) of --ssl-keyfile")


def check_request_logging(args: argparse.Namespace) -> None:
    """--enable-log-requests and --disable-log-requests together say the opposite (ValueError): refused, where
    `specserve serve` would otherwise start a gateway that exits on it, again and again."""
    if getattr(args, "enable_log_requests", None) and getattr(args, "disable_log_requests", None):
        raise ValueError("--enable-log-requests and --disable-log-requests say the opposite: give one")


def add_logging_flags(parser: argparse.ArgumentParser) -> None:
    """vLLM's logging flags, declared once for `specserve gateway` and `specserve serve` (which passes them on)."""
    parser.add_argument("--uvicorn-log-level", choices=["critical", "error", "warning", "info", "debug", "trace"],
                        help="the HTTP server's log level (default info)")
    parser.add_argument("--disable-uvicorn-access-log", action="store_true", default=None,
                        help="no log line per HTTP request")
    parser.add_argument("--disable-log-requests", action="store_true", default=None,
                        help="accepted for vLLM's command lines: requests' contents are not logged unless "
                        "--enable-log-requests (the access log's line per request is --disable-uvicorn-access-log's)")
    parser.add_argument("--enable-log-requests", action="store_true", default=None,
                        help="vLLM's flag: log a line per request at INFO with its prompt (text and token ids) and "
                        "sampling parameters (default off: prompts are users' data)")
    parser.add_argument("--max-log-len", type=int, default=None, metavar="N",
                        help="with --enable-log-requests: the prompt cut to N characters and N token ids")
