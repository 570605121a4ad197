"""vLLM's flags that have one working value here, for `specserve serve`: scripts written for `vllm serve` often pass
them at that value (`-tp 1`, `--kv-cache-dtype auto`, `--enable-chunked-prefill`), so serve takes them there and
refuses any other value at the command line with what to do instead. Accepting another value would be a flag
silently ignored; refusing the flag itself would make a user delete options that already mean what specserve
does."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def _only(value: str, why: str) -> Callable[[str], str]:
    """An argparse type that takes `value` (compared as an integer where it is one) and refuses anything else."""
    def check(text: str) -> str:
        same = text.strip() == value or (value.isdigit() and text.strip().isdigit() and int(text) == int(value))
        if not same:
            raise argparse.ArgumentTypeError(f"{text!r} is not available: {why}")
        return value

    return check


class _ChunkedPrefillOnly(argparse.Action):
    """--enable-chunked-prefill is taken; --no-enable-chunked-prefill fails the command line."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        if option_string == "--no-enable-chunked-prefill":
            parser.error("--no-enable-chunked-prefill is not available: prompts are always prefilled in chunks of "
                         "--max-num-batched-tokens; set it to at least --max-model-len to prefill each prompt in one "
                         "step")
        setattr(namespace, self.dest, True)


def add_single_value_flags(parser: argparse.ArgumentParser) -> None:
    one_device = ("specserve runs the target model on one device; serve more traffic with more verifier replicas "
                  "(a gateway takes several --verifier addresses; the chart's verifier.replicas)")
    parser.add_argument("-tp", "--tensor-parallel-size", type=_only("1", one_device), default=None, metavar="1",
                        help="vLLM's flag, 1 only: " + one_device)
    parser.add_argument("-pp", "--pipeline-parallel-size", type=_only("1", one_device), default=None, metavar="1",
                        help="vLLM's flag, 1 only: " + one_device)
    parser.add_argument("--kv-cache-dtype", type=_only("auto", "the KV cache holds the model's own dtype (--dtype)"),
                        default=None, metavar="auto", help="vLLM's flag, auto only: the KV cache in --dtype")
    parser.add_argument("--enable-chunked-prefill", "--no-enable-chunked-prefill", nargs=0, default=None,
                        action=_ChunkedPrefillOnly,
                        help="vLLM's flag, on only: prompts are prefilled in chunks of --max-num-batched-tokens")
