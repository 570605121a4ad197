"""`specserve serve`: the whole stack on one machine as three child processes (drafter, verifier, gateway),
started in dependency order, supervised, and stopped together.

The services are the same processes a deployment runs separately (docker-compose, Helm); this launcher wires
their flags, waits for each to listen, prints every endpoint, and then supervises them the way a process
manager would: a child that dies is restarted with the very same argv (same ports), after an exponential backoff,
so one crash costs the requests that were on that process and nothing else. The verifier reconnects to a restarted
drafter by itself and the gateway to a restarted verifier. SIGINT/SIGTERM stops them all, gateway first.
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from services.common.drafter_methods import SERVE_PREFERENCE, first_runnable
from services.common.speculative_config import SpeculativeConfig
from services.gateway.settings import (
    add_cors_flags,
    add_generation_config_flag,
    add_https_flags,
    add_logging_flags,
    add_root_path_flag,
    check_request_logging,
)
from services.single_value_flags import add_single_value_flags
from services.supervision import (
    Child,
    RestartPolicy,
    StartInterrupted,
    Supervisor,
    free_ports,
    parse_cpu_list,
    port_is_free,
    spawn_child,
    stop_processes,
    wait_for_port,
)
from services.verifier.settings import add_engine_flags


def default_serve_speculation() -> str:
    """Without --speculative-config, `specserve serve` drafts with the best method that runs on this machine
    (drafter_methods.SERVE_PREFERENCE: suffix, else ngram) and the speculative config's default K, and says so."""
    defaults = SpeculativeConfig()
    method, skipped = first_runnable(SERVE_PREFERENCE, defaults)
    for reason in skipped:
        print(f"specserve serve: not drafting with {reason}", file=sys.stderr, flush=True)
    return json.dumps({"method": method, "num_speculative_tokens": defaults.num_speculative_tokens})


@dataclass(frozen=True)
class TlsFlags:
    """One certificate for both gRPC servers (verifier, drafter) and the root their clients trust (the
    certificate itself when it is self-signed and no --tls-root-cert is given)."""

    cert_file: str | None
    key_file: str | None
    root_cert: str | None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> TlsFlags:
        if bool(args.tls_cert_file) != bool(args.tls_key_file):
            raise ValueError("--tls-cert-file and --tls-key-file go together")
        root = args.tls_root_cert or args.tls_cert_file
        return cls(args.tls_cert_file, args.tls_key_file, root)

    @property
    def server_flags(self) -> list[str]:
        return ["--tls-cert-file", self.cert_file, "--tls-key-file", self.key_file] if self.cert_file else []

    @property
    def drafter_client_flags(self) -> list[str]:
        return ["--drafter-tls-root-cert", self.root_cert] if self.cert_file else []

    @property
    def gateway_flags(self) -> list[str]:
        return ["--grpc-root-cert", self.root_cert] if self.cert_file else []


ENGINE_FLAGS = (
    "model", "device", "dtype", "trust_remote_code", "max_num_seqs", "max_model_len", "max_num_batched_tokens",
    "compute_thread", "adaptive_speculation", "kv_cache_memory_bytes", "gpu_memory_utilization", "block_size", "enable_prefix_caching",
    "max_logprobs", "enforce_eager", "cuda_graph_sizes", "batch_invariant", "seed",
)
# the gateway's flags that serve takes (add_arguments) and passes on as given
GATEWAY_FLAGS = (
    "served_model_name", "chat_template", "tool_call_parser", "api_key", "allowed_origins", "allowed_methods",
    "allowed_headers", "allow_credentials", "uvicorn_log_level", "disable_uvicorn_access_log", "ssl_keyfile",
    "ssl_certfile", "trust_remote_code", "generation_config", "root_path", "enable_log_requests", "max_log_len",
)


def _given_flags(args: argparse.Namespace, names: Sequence[str]) -> list[str]:
    """Only the flags of `names` given on this command line: the others are left to the service's settings, so
    its defaults and SPECSERVE_VERIFIER_* (SPECSERVE_GATEWAY_*) environment variables hold under `specserve serve`
    too."""
    flags = []
    for name in names:
        value = getattr(args, name, None)
        flag = name.replace("_", "-")
        if isinstance(value, bool):  # an on/off flag: --name or --no-name
            flags.append(f"--{flag}" if value else f"--no-{flag}")
        elif isinstance(value, list):  # nargs="+"
            flags += [f"--{flag}", *map(str, value)]
        elif value is not None:
            flags += [f"--{flag}", str(value)]
    return flags


def with_shipped_head(spec: SpeculativeConfig, target: str | None) -> SpeculativeConfig:
    """eagle or eagle3 without a model drafts with the head of that kind that ships for the served target; a target
    with none is a usage error now, before any process starts. An EAGLE head shares the served target's embedding
    and LM head: target_model names the served --model (a published head's config names its target by Hub id, and
    a shipped head's is the served model already), unless the config says otherwise."""
    if spec.method not in ("eagle", "eagle3"):
        return spec
    if not spec.model:
        from services.modeling.eagle_heads import shipped_head

        spec = spec.model_copy(update={"model": str(shipped_head(target, spec.method))})
    if target and getattr(spec, "target_model", None) is None:
        spec = spec.model_copy(update={"target_model": target})
    return spec


def beside_the_verifier(spec: SpeculativeConfig, args: argparse.Namespace) -> SpeculativeConfig:
    """A draft model or an EAGLE head runs where `serve --device/--dtype` put the target, for as many sequences as
    `--max-num-seqs` lets the verifier run, and with `--enforce-eager` never replays captured graphs, unless the
    speculative config says otherwise (draft_device, draft_dtype, draft_max_num_seqs, enforce_eager): on a GPU
    host, both on the GPU, and a model drafter's graphs captured at start-up for every batch the verifier sends."""
    if spec.method not in ("draft_model", "eagle", "eagle3"):
        return spec
    given = {"draft_device": getattr(args, "device", None), "draft_dtype": getattr(args, "dtype", None),
             "draft_max_num_seqs": getattr(args, "max_num_seqs", None),
             "enforce_eager": getattr(args, "enforce_eager", None) or None}
    update = {name: value for name, value in given.items()
              if value is not None and name not in spec.model_fields_set}
    return spec.model_copy(update=update) if update else spec


def plan(args: argparse.Namespace) -> list[Child]:
    """The three commands, in start order."""
    python = [sys.executable, "-m", "services.cli"]
    spec = with_shipped_head(SpeculativeConfig.parse(args.speculative_config or default_serve_speculation()),
                             args.model)
    spec = beside_the_verifier(spec, args)
    tls = TlsFlags.from_args(args)
    if bool(args.ssl_keyfile) != bool(args.ssl_certfile):  # refused before the verifier loads, not by the gateway
        raise ValueError("--ssl-keyfile and --ssl-certfile go together: HTTPS needs the key and its certificate")
    check_request_logging(args)
    children = []
    verifier = [
        *python, "verifier", *_given_flags(args, ENGINE_FLAGS), "--host", args.host, "--port", str(args.verifier_port),
        "--metrics-port", str(args.verifier_metrics_port), *tls.server_flags,
        *(["--disable-log-stats"] if args.disable_log_stats else []),
    ]
    if spec.extract_dir is not None:  # no drafter: the verifier serves and writes hidden states
        verifier += ["--speculative-config", json.dumps({"method": spec.method, "output_dir": spec.output_dir})]
    if spec.enabled:
        spec_json = json.dumps({"method": spec.method, **spec.model_dump(exclude_defaults=True)})  # short, readable
        verifier += ["--speculative-config", spec_json]
        drafter = [  # the same config: the drafter builds the method it names, with all of that method's options
            *python, "drafter", "--speculative-config", spec_json,
            "--host", args.host, "--port", str(args.drafter_port),
            "--metrics-port", str(args.drafter_metrics_port), *tls.server_flags,
        ]
        children.append(Child("drafter", drafter, args.host, args.drafter_port, args.drafter_cpus or ()))
        verifier += ["--drafter", f"{spec.method}={args.host}:{args.drafter_port}", *tls.drafter_client_flags]
    children.append(Child("verifier", verifier, args.host, args.verifier_port, args.verifier_cpus or ()))
    gateway = [  # without --model the gateway loads the tokenizer of the model the verifier reports
        *python, "gateway", "--host", args.host, "--port", str(args.port),
        "--verifier", f"{args.host}:{args.verifier_port}", *tls.gateway_flags,
        "--verifier-shared-stream",  # one verifier: its requests share one GenerateMany call
    ]
    if args.model is not None:
        gateway += ["--model", args.model]
    gateway += _given_flags(args, GATEWAY_FLAGS)
    children.append(Child("gateway", gateway, args.host, args.port))
    if args.download_dir is not None:  # vLLM's flag: where model files are fetched to and read from
        cache = ("SPECSERVE_CACHE_DIR", str(Path(args.download_dir).expanduser().resolve()))
        children = [replace(child, env=(*child.env, cache)) for child in children]
    return children


def _banner(args: argparse.Namespace, children: Sequence[Child]) -> str:
    base = f"{'https' if args.ssl_certfile else 'http'}://{args.host}:{args.port}"
    drafter = (
        f"  drafter gRPC {args.host}:{args.drafter_port}, {_metrics(args.host, args.drafter_metrics_port)}\n"
        if any(child.name == "drafter" for child in children)
        else ""
    )
    return (
        "\nspecserve is serving:\n"
        f"  POST {base}/v1/completions\n  POST {base}/v1/chat/completions\n  POST {base}/v1/responses\n"
        f"  GET  {base}/v1/models\n"
        f"  GET  {base}/health\n  GET  {base}/metrics\n  POST {base}/tokenize, {base}/detokenize\n"
        f"  verifier gRPC {args.host}:{args.verifier_port}, {_metrics(args.host, args.verifier_metrics_port)}\n"
        f"{drafter}"
        "Children that exit are restarted; Ctrl-C stops everything."
    )


def _metrics(host: str, port: int | None) -> str:
    """Where a child's Prometheus metrics are; a metrics port of 0 turns them off (not "any free port")."""
    return f"metrics http://{host}:{port}/metrics" if port else "metrics off"


def serve(children: Sequence[Child], policy: RestartPolicy, *, start_timeout_s: float, banner: str = "",
          tick_s: float = 0.2, spawn: Callable[[Child], subprocess.Popen] = spawn_child) -> int:
    """Start `children` in order, each once the previous one listens (a failure there stops everything: exit
    1), then supervise them until SIGINT/SIGTERM and stop them in reverse order (exit 0)."""
    stopping = False

    def stop_all(*_: object) -> None:
        nonlocal stopping
        stopping = True

    supervisor = Supervisor(policy, spawn)
    started: list[subprocess.Popen] = []
    previous = {sig: signal.signal(sig, stop_all) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        for child in children:
            print(f"starting {child.name}: {' '.join(child.argv[1:])}", flush=True)
            process = spawn(child)
            started.append(process)
            try:
                wait_for_port(child.host, child.port, process, start_timeout_s, cancelled=lambda: stopping,
                              while_busy=True)
            except (RuntimeError, TimeoutError) as error:  # name the service that failed to start
                raise type(error)(f"{child.name} did not start: {error}") from error
            print(f"{child.name} is listening on {child.host}:{child.port} (pid {process.pid})", flush=True)
            supervisor.adopt(child, process)
        if banner:
            print(banner, flush=True)
        while not stopping:
            supervisor.tick()
            time.sleep(tick_s)
        return 0
    except StartInterrupted:
        return 0
    except (RuntimeError, TimeoutError) as error:
        print(f"specserve serve: {error}", file=sys.stderr, flush=True)
        return 1
    finally:
        processes = supervisor.processes + started[len(supervisor.processes):]
        stop_processes(list(reversed(processes)))  # gateway first, drafter last
        if any(supervisor.restarts.values()):
            counts = ", ".join(f"{name} {n}" for name, n in supervisor.restarts.items())
            print(f"restarts: {counts}", flush=True)
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)


SERVICE_PORTS = ("port", "verifier_port", "drafter_port")  # 0: any free port (a metrics port 0 turns metrics off)


def with_free_ports(args: argparse.Namespace) -> argparse.Namespace:
    """`args` with every service port given as 0 replaced by a free one, chosen once: a restarted child gets the
    same port again, and the banner and the other children's flags name the real one."""
    zero = [name for name in SERVICE_PORTS if getattr(args, name) == 0]
    return argparse.Namespace(**{**vars(args), **dict(zip(zero, free_ports(len(zero), args.host), strict=True))})


def cpu_list(text: str) -> tuple[int, ...]:
    try:
        return parse_cpu_list(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def port_number(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port number (0..65535; 0: any free port)")
    return value


def with_model_tag(args: argparse.Namespace) -> argparse.Namespace:
    """`args` with the positional model (`specserve serve MODEL`, as `vllm serve MODEL`) as --model; both given, they
    must agree."""
    tag = getattr(args, "model_tag", None)
    if tag is None:
        return args
    if args.model is not None and args.model != tag:
        raise ValueError(f"the model is given twice, as {tag!r} and as --model {args.model!r}; give it once")
    return argparse.Namespace(**{**vars(args), "model": tag})


def taken_ports(args: argparse.Namespace, children: Sequence[Child]) -> list[str]:
    """What keeps the stack from starting as planned: each port it would bind that something else listens on, or
    that two of its flags name, said with its flag. Checked before any child starts: a child that cannot bind its
    port exits and is restarted forever, and the launcher, which waits for each port to open, took the other
    process listening there for the child started."""
    flags = {
        "gateway": [("--port", args.port)],
        "verifier": [("--verifier-port", args.verifier_port), ("--verifier-metrics-port", args.verifier_metrics_port)],
        "drafter": [("--drafter-port", args.drafter_port), ("--drafter-metrics-port", args.drafter_metrics_port)],
    }
    problems, named = [], {}
    for flag, port in (pair for child in children for pair in flags[child.name] if pair[1]):  # metrics 0: off
        if port in named:
            problems.append(f"{flag} and {named[port]} both name port {port}")
        elif not port_is_free(args.host, port):
            problems.append(f"port {port} on {args.host} ({flag}) is in use: stop what listens there (another "
                            "specserve serve?) or choose another port (0: any free one)")
        named.setdefault(port, flag)
    return problems


def run(args: argparse.Namespace) -> int:
    args = with_free_ports(with_model_tag(args))
    children = plan(args)
    problems = taken_ports(args, children)
    if problems:
        print("\n".join(f"specserve serve: {problem}" for problem in problems), file=sys.stderr)
        return 1
    policy = RestartPolicy(initial_backoff_s=args.restart_backoff_initial_s,
                           max_backoff_s=args.restart_backoff_max_s, reset_after_s=args.restart_backoff_reset_s)
    return serve(children, policy, start_timeout_s=args.start_timeout_s, banner=_banner(args, children))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="the model to serve, as in `vllm serve MODEL`: the same as --model")
    parser.add_argument("--config", metavar="FILE.yaml",
                        help="vLLM's config file: a YAML mapping of these options' names to values (model: NAME, "
                        "max-num-seqs: 16, enforce-eager: true, speculative-config: {method: ngram}); flags on the "
                        "command line win over the file's")
    add_engine_flags(parser, default=None)  # unset: the verifier's own settings (defaults or environment) decide
    parser.add_argument("--download-dir", default=None, metavar="DIR",
                        help="where registered models are fetched to and read from (every service's "
                        "SPECSERVE_CACHE_DIR; default ~/.cache/specserve/models)")
    parser.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                        help="the names clients send as 'model'; responses give the first (default: the model's id)")
    parser.add_argument("--tool-call-parser", default=None,
                        help="how the model writes tool calls: hermes (default; Qwen2.5, Hermes)")
    parser.add_argument("--chat-template", default=None,
                        help="a Jinja chat template, or the path of a file holding one, for every chat request in "
                        "place of the model's own (the gateway's)")
    add_cors_flags(parser)
    add_logging_flags(parser)
    add_https_flags(parser)
    add_root_path_flag(parser)
    add_generation_config_flag(parser)
    add_single_value_flags(parser)
    parser.add_argument("--disable-log-stats", action="store_true",
                        help="vLLM's flag: no periodic stats log line from the verifier")
    parser.add_argument("--enable-prompt-tokens-details", action="store_true",
                        help="accepted for vLLM's command lines: usage always has prompt_tokens_details.cached_tokens "
                        "(the prompt tokens found in the prefix cache)")
    parser.add_argument("--enable-auto-tool-choice", action="store_true",
                        help="accepted for vLLM's command lines: tool calls (tool_choice auto, none, required or a "
                        "named function) are always on")
    parser.add_argument(
        "--speculative-config", default=None,
        help="JSON (default: suffix, or ngram where arctic-inference is not installed, K = 5, on a drafter of its "
             "own); '{\"method\": \"none\"}' serves without speculation",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=port_number, default=8000, help="gateway HTTP port (0: any free port)")
    parser.add_argument("--verifier-port", type=port_number, default=50051, help="0: any free port")
    parser.add_argument("--verifier-metrics-port", type=port_number, default=8001, help="0: no metrics endpoint")
    parser.add_argument("--drafter-port", type=port_number, default=50061, help="0: any free port")
    parser.add_argument("--drafter-metrics-port", type=port_number, default=8002, help="0: no metrics endpoint")
    parser.add_argument("--tls-cert-file", default=None, help="PEM certificate: the verifier and drafter serve TLS")
    parser.add_argument("--tls-key-file", default=None, help="PEM private key of --tls-cert-file")
    parser.add_argument("--tls-root-cert", default=None, help="PEM root the gRPC clients trust (default: the cert)")
    parser.add_argument("--verifier-cpus", type=cpu_list, default=None, metavar="LIST",
                        help="run the verifier on these CPUs only (taskset's syntax, e.g. 0-5); its torch threads "
                        "follow. Default: all of the launcher's")
    parser.add_argument("--drafter-cpus", type=cpu_list, default=None, metavar="LIST",
                        help="run the drafter on these CPUs only (e.g. 6,7), so drafting and verifying do not "
                        "share cores. Default: all of the launcher's")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--start-timeout-s", type=float, default=300.0,
                        help="at start-up, how long each service may go without working (using CPU) and without "
                        "listening before serve gives up; a service that keeps loading is waited for")
    defaults = RestartPolicy()
    parser.add_argument("--restart-backoff-initial-s", type=float, default=defaults.initial_backoff_s,
                        help="delay before restarting a service that exited (doubles with each crash in a row)")
    parser.add_argument("--restart-backoff-max-s", type=float, default=defaults.max_backoff_s,
                        help="cap of the restart delay; a service that keeps crashing is retried this often")
    parser.add_argument("--restart-backoff-reset-s", type=float, default=defaults.reset_after_s,
                        help="a service up this long before it exits is restarted after the initial delay again")
