"""A command line written for `vllm serve`, read by `specserve serve`: vLLM's `--config` YAML file of options, its
flag names written with underscores (`--max_model_len`, which vLLM's parser takes), and, for each vLLM flag that
has no counterpart here, why and what to do instead, where argparse alone says "unrecognized arguments" and leaves
the user guessing whether the flag is misspelt, unsupported, or spelt another way. A close misspelling of a flag
this command has is named ("did you mean --max-model-len?")."""

from __future__ import annotations

import argparse
import difflib
import json
from collections.abc import Callable, Sequence
from pathlib import Path

CONFIG_FLAG = "--config"
ONE_DEVICE = "specserve runs the target on one device; more traffic goes to more verifier replicas"
RECOMPUTED = ("a request whose KV blocks are taken back for others is recomputed when it resumes (vLLM's recompute "
              "preemption), never swapped to host memory")
# vLLM flags `specserve serve` has no counterpart for, each with why (and what to do instead). Flags that exist
# here with one working value (-tp 1, --kv-cache-dtype auto, ...) are in single_value_flags.py instead.
NOT_HERE = {
    "--swap-space": RECOMPUTED + "; leave it out",
    "--preemption-mode": RECOMPUTED + "; leave it out",
    "--cpu-offload-gb": "the weights stay whole on --device",
    "--quantization": "weights are served in --dtype (a GGUF model's are dequantized to it)",
    "-q": "vLLM's --quantization: weights are served in --dtype (a GGUF model's are dequantized to it)",
    "--load-format": "weights load from what the model has (safetensors, or a GGUF file); leave it out",
    "--revision": "a registered model is one pinned, checksummed version and a local folder is what it holds: "
                  "name the model or folder with --model",
    "--code-revision": "a model's remote code is the one its folder holds (with --trust-remote-code)",
    "--tokenizer": "the tokenizer is always the model's own (--model), whose token ids the verifier reads; a "
                   "different chat template goes in --chat-template",
    "--tokenizer-revision": "the tokenizer is always the model's own (--model)",
    "--data-parallel-size": ONE_DEVICE + " (a gateway takes several --verifier addresses; the chart's "
                            "verifier.replicas)",
    "-dp": "vLLM's --data-parallel-size: " + ONE_DEVICE,
    "--distributed-executor-backend": ONE_DEVICE,
    "--enable-lora": "LoRA adapters are not served: merge the adapter into the weights and serve that folder",
    "--lora-modules": "LoRA adapters are not served: merge the adapter into the weights and serve that folder",
    "--max-loras": "LoRA adapters are not served",
    "--max-lora-rank": "LoRA adapters are not served",
    "--limit-mm-per-prompt": "text models only: no image, audio or video inputs",
    "--mm-processor-kwargs": "text models only: no image, audio or video inputs",
    "--reasoning-parser": "no reasoning parser: a model's reasoning stays in the message content",
    "--enable-reasoning": "no reasoning parser: a model's reasoning stays in the message content",
    "--speculative-model": "speculation is set with --speculative-config, e.g. "
                           "'{\"method\": \"draft_model\", \"model\": \"NAME\", \"num_speculative_tokens\": 4}'",
    "--num-speculative-tokens": "speculation is set with --speculative-config, e.g. "
                                "'{\"method\": \"ngram\", \"num_speculative_tokens\": 4}'",
    "--ngram-prompt-lookup-max": "speculation is set with --speculative-config, e.g. "
                                 "'{\"method\": \"ngram\", \"prompt_lookup_max\": 4}'",
    "--ngram-prompt-lookup-min": "speculation is set with --speculative-config, e.g. "
                                 "'{\"method\": \"ngram\", \"prompt_lookup_min\": 2}'",
    "--compilation-config": "the accelerator step is set with --cuda-graph-sizes and --enforce-eager",
    "-O": "vLLM's --compilation-config: the accelerator step is set with --cuda-graph-sizes and --enforce-eager",
    "--max-seq-len-to-capture": "the captured batch sizes are --cuda-graph-sizes; --enforce-eager turns capture off",
    "--num-scheduler-steps": "the verifier plans every step; leave it out",
    "--response-role": "chat responses always come from the 'assistant' role",
    "--return-tokens-as-token-ids": "a request asks for logprob tokens as \"token_id:N\" with "
                                    "return_tokens_as_token_ids: true",
    "--hf-overrides": "the model is served with its own config.json",
    "--override-generation-config": "request defaults come from --generation-config (auto, vllm or a folder)",
    "--rope-scaling": "the model is served with its own config.json",
    "--task": "text generation only",
    "--runner": "text generation only",
    "--guided-decoding-backend": "structured output always uses llguidance",
    "--structured-outputs-config": "structured output always uses llguidance",
    "--uds": "the gateway listens on --host and --port",
    "--enable-sleep-mode": "the verifier keeps its model loaded while it runs",
    "--kv-transfer-config": "KV blocks stay in the verifier that computed them",
}


def dashed(argv: Sequence[str]) -> list[str]:
    """`argv` with each long flag's name spelt with dashes (`--max_model_len=8` → `--max-model-len=8`), as vLLM's
    parser takes both; values are left as they are."""
    out = []
    for token in argv:
        if token.startswith("--") and len(token) > 2:
            name, sep, value = token.partition("=")
            token = name.replace("_", "-") + sep + value
        out.append(token)
    return out


def config_path(argv: Sequence[str]) -> str | None:
    """The --config file's path, if the command line names one."""
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument(CONFIG_FLAG)
    return pre.parse_known_args(list(argv))[0].config


def config_tokens(path: str) -> list[str]:
    """The options of a vLLM config file (YAML: option names, with dashes or underscores, to values) as command
    line tokens: `true` a bare flag, `false` its --no- form (which apply_config_file drops where the flag has none:
    off is a switch's default), a list the flag and each item, a mapping JSON (--speculative-config), anything
    else `--name=value`; `null` leaves it out."""
    import yaml  # only a command line with --config needs it

    try:
        data = yaml.safe_load(Path(path).expanduser().read_text(encoding="utf-8"))
    except OSError as error:
        raise ValueError(f"{CONFIG_FLAG} {path}: {error.strerror or error}") from error
    except (yaml.YAMLError, UnicodeDecodeError) as error:
        raise ValueError(f"{CONFIG_FLAG} {path} is not a YAML file: {error}") from error
    if data is None:
        return []
    if not isinstance(data, dict):
        raise ValueError(f"{CONFIG_FLAG} {path} must map option names to values (model: NAME, port: 8000, ...)")
    tokens: list[str] = []
    for key, value in data.items():
        flag = "--" + str(key).lstrip("-").replace("_", "-")
        if flag == CONFIG_FLAG:
            raise ValueError(f"{CONFIG_FLAG} {path} names another {CONFIG_FLAG}: give one file")
        if value is None or value is False:
            tokens += [f"--no-{flag[2:]}"] if value is False else []
        elif value is True:
            tokens.append(flag)
        elif isinstance(value, list):
            tokens += [flag, *(json.dumps(item) if isinstance(item, dict) else str(item) for item in value)]
        elif isinstance(value, dict):
            tokens.append(f"{flag}={json.dumps(value)}")
        else:
            tokens.append(f"{flag}={value}")
    return tokens


def option_strings(parser: argparse.ArgumentParser) -> list[str]:
    """Every flag `parser` takes (argparse keeps them on `_actions`, which vLLM's own parser reads too)."""
    return sorted(option for action in parser._actions for option in action.option_strings)


def apply_config_file(parser: argparse.ArgumentParser, path: str,
                      add_arguments: Callable[[argparse.ArgumentParser], None]) -> dict[str, object]:
    """Make the options of the config file at `path` `parser`'s defaults, so that the command line's own flags
    win over the file's, as in vLLM; returns those defaults. `add_arguments` declares `parser`'s arguments; the
    file is read by a parser it builds the same way, so its values pass the flags' own checks, and an option this
    command does not have is refused as on the command line."""
    tokens = config_tokens(path)
    known = set(option_strings(parser))
    tokens = [t for t in tokens if not t.startswith("--no-") or t in known]  # false: off, a switch's default
    reader = argparse.ArgumentParser(prog=f"{parser.prog} {CONFIG_FLAG} {path}", add_help=False)
    add_arguments(reader)
    read, unknown = reader.parse_known_args(tokens)
    if unknown:
        reader.error(unrecognized(unknown, sorted(known)))
    defaults = {dest: value for dest, value in vars(read).items() if value != parser.get_default(dest)}
    parser.set_defaults(**defaults)
    return defaults


def unrecognized(unknown: Sequence[str], known: Sequence[str]) -> str:
    """argparse's "unrecognized arguments", said for each flag: vLLM's flags that have no counterpart here with why
    (NOT_HERE), a near miss of a known flag with the flag meant. A word right after an unknown flag is taken for its
    value and not listed again."""
    said, strays = [], []
    for i, token in enumerate(unknown):
        if not token.startswith("-"):
            if i == 0 or not unknown[i - 1].startswith("-") or "=" in unknown[i - 1]:
                strays.append(token)
            continue
        name = token.partition("=")[0]
        if name in NOT_HERE:
            said.append(f"{name} (vLLM's) is not available: {NOT_HERE[name]}")
        else:
            close = difflib.get_close_matches(name, known, n=1, cutoff=0.8)
            said.append(f"unrecognized argument {name}" + (f" (did you mean {close[0]}?)" if close else ""))
    if strays:
        said.append("unrecognized arguments: " + " ".join(strays))
    return "; ".join(said)
