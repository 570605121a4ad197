"""`specserve verifier`: its flags and its entry point, apart from server.py so that `--help` and a bad flag answer
at once instead of after importing torch and transformers (11 s on 2 cores)."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence

from services.verifier.settings import VerifierSettings, add_engine_flags


def add_verifier_flags(parser: argparse.ArgumentParser) -> None:
    """vLLM-style flags. Unset flags leave the SPECSERVE_VERIFIER_* environment (or the default) in charge."""
    s = argparse.SUPPRESS
    add_engine_flags(parser)
    parser.add_argument("--max-waiting-requests", dest="max_waiting_requests", type=int, default=s)
    parser.add_argument("--draft-timeout-s", dest="draft_timeout_s", type=float, default=s,
                        help="shortest wait for a drafter's drafts per step (default 0.5)")
    parser.add_argument("--max-draft-timeout-s", dest="max_draft_timeout_s", type=float, default=s,
                        help="longest: the wait grows to twice what the drafter's calls take, up to this (default 2)")
    parser.add_argument("--drafter-health-interval-s", dest="drafter_health_interval_s", type=float, default=s,
                        help="probe a drafter's Info after this long without a successful step (0: never)")
    parser.add_argument("--speculative-config", dest="speculative_config", default=s,
                        help='JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 5}\'')
    parser.add_argument("--drafter", dest="drafters", action="append", default=s, metavar="NAME=HOST:PORT",
                        help="attach a drafter service (repeatable); requests select it by NAME")
    parser.add_argument("--host", default=s)
    parser.add_argument("--port", type=int, default=s, help="gRPC port (0: a free one)")
    parser.add_argument("--metrics-port", dest="metrics_port", type=int, default=s, help="0 turns metrics off")
    parser.add_argument("--log-stats-interval-s", dest="log_stats_interval_s", type=float, default=s,
                        help="seconds between 'spec decode:' log lines (acceptance, tokens/s, fallbacks); 0: none")
    parser.add_argument("--disable-log-stats", dest="log_stats_interval_s", action="store_const", const=0.0, default=s,
                        help="vLLM's flag: no periodic stats log line (as --log-stats-interval-s 0)")
    parser.add_argument("--drain-seconds", dest="drain_s", type=float, default=s)
    parser.add_argument("--grace-seconds", dest="grace_s", type=float, default=s)
    parser.add_argument("--tls-cert-file", dest="tls_cert_file", default=s)
    parser.add_argument("--tls-key-file", dest="tls_key_file", default=s)
    parser.add_argument("--measurement-cache-dir", dest="measurement_cache_dir", default=s,
                        help="reuse the start-up measurements (thread placement, step-cost profile) taken on this "
                        "machine with this model and setup, kept here (default ~/.cache/specserve/measurements; '' "
                        "measures at every start)")
    parser.add_argument("--drafter-tls-root-cert", dest="drafter_tls_root_cert", default=s,
                        help="PEM root certificate: connect to drafters over TLS")
    parser.add_argument("--hidden-layers", dest="hidden_layers", type=layer_list, default=s, metavar="LIST",
                        help="target layers whose hidden states drafters read, e.g. 2,15,27 for an EAGLE-3 head (-1: "
                        "the final normed one; default: what the drafters reached at start-up declare)")


def layer_list(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated layer numbers like 2,15,27, got {text!r}") from None


def settings_from_args(args: argparse.Namespace) -> VerifierSettings:
    """Only the settings' own fields: a CLI that nests this parser may add its own (e.g. the subcommand)."""
    return VerifierSettings(**{k: v for k, v in vars(args).items() if k in VerifierSettings.model_fields})


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(prog="specserve verifier", description="Serve a target model over gRPC.")
    add_verifier_flags(parser)
    settings = settings_from_args(parser.parse_args(argv))
    from services.verifier.server import run  # torch and transformers: only once the flags are valid

    return run(settings)
