"""`specserve` command line. Flags follow vLLM's names (--model, --dtype, --device, --max-num-seqs,
--max-model-len, --max-num-batched-tokens, --speculative-config JSON)."""

from __future__ import annotations

import argparse
import asyncio
import importlib
import logging
import sys
import time
import uuid

from services import launcher, vllm_command_line
from services.common.startup_errors import DeviceUnavailableError, PortUnavailableError
from services.common.speculative_config import SpeculativeConfig
from services.modeling.model_source import ModelUnavailableError, resolve_model_source
from services.verifier.settings import VerifierSettings, add_engine_flags

LOCAL_ENGINE_FLAGS = (
    "model", "device", "dtype", "trust_remote_code", "max_num_seqs", "max_model_len", "max_num_batched_tokens",
    "adaptive_speculation", "kv_cache_memory_bytes", "gpu_memory_utilization", "block_size", "enable_prefix_caching", "enforce_eager",
    "cuda_graph_sizes", "batch_invariant",
)


def _cmd_fetch(args: argparse.Namespace) -> int:
    from services.modeling.fetch import fetch_registered_model

    path = fetch_registered_model(args.name)
    print(path)
    return 0


async def _generate(args: argparse.Namespace) -> int:
    from services.inprocess import LocalEngineOptions, build_local_engine, default_speculation
    from services.verifier.sampling_params import GenerationRequest, SamplingParams

    spec_config = SpeculativeConfig.parse(args.speculative_config)
    given = {name: getattr(args, name) for name in LOCAL_ENGINE_FLAGS if getattr(args, name) is not None}
    options = LocalEngineOptions(**given, speculative_config=spec_config)
    engine, loaded = build_local_engine(options)
    tokenizer = loaded.tokenizer
    messages = [{"role": "user", "content": args.prompt}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(prompt, "keys"):
        prompt = prompt["input_ids"]
    request = GenerationRequest(
        f"cli-{uuid.uuid4().hex[:8]}",
        tuple(int(t) for t in prompt),
        SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed),
        default_speculation(spec_config),
    )
    generated: list[int] = []
    printed = ""
    started = time.perf_counter()
    last = None
    async with engine:
        async for output in engine.generate(request):
            generated.extend(output.token_ids)
            text = tokenizer.decode(generated, skip_special_tokens=True)
            if not text.endswith("\ufffd"):  # never print half a multi-byte character
                sys.stdout.write(text[len(printed):])
                sys.stdout.flush()
                printed = text
            last = output
    elapsed = time.perf_counter() - started
    assert last is not None
    print(
        f"\n\n[{last.num_output_tokens} tokens in {elapsed:.2f} s = {last.num_output_tokens / elapsed:.1f} tok/s; "
        f"finish_reason={last.finish_reason}; speculation: drafts={last.spec.num_drafts}, "
        f"acceptance rate={last.spec.acceptance_rate:.2f}, mean acceptance length={last.spec.mean_acceptance_length:.2f}]",
        file=sys.stderr,
    )
    return 0


# Subcommands whose module parses its own flags (each service keeps one parser, also used standalone).
DELEGATED = {
    "bench": "services.bench",
    "drafter": "services.drafter.server",
    "verifier": "services.verifier.main",
    "gateway": "services.gateway.main",
    "soak": "services.soak.main",
    "train-eagle": "services.eagle.train",
}
# The pyproject extra that brings what each command imports beyond the core install (`pip install specserve`).
# The drafter's ngram method needs nothing more; its model methods need the draft-model extra.
COMMAND_EXTRAS = {"bench": "bench", "drafter": "draft-model", "verifier": "verifier", "gateway": "gateway",
                  "soak": "bench", "train-eagle": "train"}


def _check_verifier_model(argv: list[str]) -> None:
    """Resolve (and, the first time, fetch) the verifier's model before its module imports torch and transformers
    (~7 s on 2 cores): a model that is neither on disk nor fetchable then fails the start in about a second. The
    model is the one VerifierSettings picks (the flag, else SPECSERVE_VERIFIER_MODEL, else the default); settings
    it cannot read are left to the verifier's own parser to report."""
    if {"-h", "--help"} & set(argv):
        return
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--model")
    given = parser.parse_known_args(argv)[0].model
    try:
        model = VerifierSettings(**({"model": given} if given else {})).model
    except ValueError:
        return
    resolve_model_source(model)


def _delegate(command: str, argv: list[str]) -> int:
    try:
        if command == "verifier":
            _check_verifier_model(argv)
    except ModelUnavailableError as error:
        print(f"specserve {command}: error: {error}", file=sys.stderr)
        return 1
    try:
        module = importlib.import_module(DELEGATED[command])
        return module.main(argv)
    except ModuleNotFoundError as error:
        missing = (error.name or "").split(".")[0]
        if not missing or missing == "services":
            raise  # this project's own module: a bug, with its traceback
        print(f"specserve {command}: this install lacks {missing!r}, which the command needs; install its extra: "
              f"pip install 'specserve[{COMMAND_EXTRAS[command]}]'", file=sys.stderr)
        return 1
    except ValueError as error:  # settings validation (pydantic's errors are ValueErrors) and bad files
        print(f"specserve {command}: error: {error}", file=sys.stderr)
        return 2
    except (ModelUnavailableError, DeviceUnavailableError, PortUnavailableError) as error:  # not a traceback
        print(f"specserve {command}: error: {error}", file=sys.stderr)
        return 1


def build_parser() -> argparse.ArgumentParser:
    return build_parsers()[0]


def build_parsers() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """The command's parser, and its `serve` subcommand's (which a --config file gives defaults)."""
    parser = argparse.ArgumentParser(prog="specserve", description="Speculative decoding, split into services.")
    parser.add_argument("--log-level", default="INFO")
    sub = parser.add_subparsers(dest="command", required=True)
    fetch = sub.add_parser("fetch", help="download a registered model into the cache (sha256-verified)")
    fetch.add_argument("name")
    generate = sub.add_parser("generate", help="generate one completion in-process (engine + local drafter)")
    add_engine_flags(generate, default=None, compute_thread=False, serving=False)  # unset: LocalEngineOptions' defaults
    generate.add_argument("--speculative-config", default=None,
                          help='JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 5}\' (default: none)')
    generate.add_argument("--prompt", default="Write a Python function that returns the n-th Fibonacci number.")
    generate.add_argument("--max-tokens", type=int, default=128)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--seed", type=int, default=None)
    serve = sub.add_parser("serve", help="the whole stack (drafter, verifier, gateway) as child processes")
    launcher.add_arguments(serve)
    for command, what in (
        ("bench", "benchmark"),
        ("drafter", "the drafter gRPC service"),
        ("verifier", "the verifier gRPC service (target model)"),
        ("gateway", "the OpenAI-compatible HTTP gateway"),
        ("soak", "the stack under saturating mixed traffic, with pass/fail targets"),
        ("train-eagle", "train an EAGLE head for a target on ShareGPT (resumable)"),
    ):
        sub.add_parser(command, help=f"{what} (see `specserve {command} --help`)", add_help=False)
    return parser, serve


def parse_command_line(argv: list[str]) -> argparse.Namespace:
    """The command line, read as argparse does, except that `serve` reads one written for `vllm serve` too: a
    --config YAML file's options as defaults, flag names with underscores, and a reason for each vLLM flag it has
    no counterpart for (services/vllm_command_line.py)."""
    parser, serve = build_parsers()
    if parser.parse_known_args(argv)[0].command != "serve":
        return parser.parse_args(argv)
    argv = vllm_command_line.dashed(argv)
    path, from_file = vllm_command_line.config_path(argv), {}
    if path is not None:
        try:
            from_file = vllm_command_line.apply_config_file(serve, path, launcher.add_arguments)
        except ValueError as error:
            serve.error(str(error))
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        serve.error(vllm_command_line.unrecognized(unknown, vllm_command_line.option_strings(serve)))
    if args.model_tag is not None and args.model is not None and args.model == from_file.get("model"):
        args.model = None  # a MODEL on the command line replaces the file's model, as in vLLM
    return args


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] and argv[0] in DELEGATED:
        level = logging.WARNING if argv[0] in ("bench", "soak") else logging.INFO
        logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        return _delegate(argv[0], argv[1:])
    args = parse_command_line(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "fetch":
            return _cmd_fetch(args)
        if args.command == "generate":
            return asyncio.run(_generate(args))
        if args.command == "serve":
            return launcher.run(args)
    except ValueError as error:
        print(f"specserve: error: {error}", file=sys.stderr)
        return 2
    except (ModelUnavailableError, DeviceUnavailableError, PortUnavailableError) as error:
        print(f"specserve {args.command}: error: {error}", file=sys.stderr)
        return 1
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
