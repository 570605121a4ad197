"""`specserve serve` reads a command line written for `vllm serve`: a --config YAML file whose options the command
line's own flags override, flag names with underscores, and a reason for each vLLM flag it has no counterpart for."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from services import cli, launcher, vllm_command_line
from services.common.speculative_config import SpeculativeConfig

REPO = Path(__file__).resolve().parents[2]


def flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def serve_plan(*argv: str):
    """The children `specserve serve ARGV` would start, from its command line as main() reads it."""
    return launcher.plan(launcher.with_model_tag(cli.parse_command_line(["serve", *argv])))


def refusal(capsys, *argv: str) -> str:
    """What `specserve serve ARGV` says when it refuses its command line (argparse's exit 2)."""
    with pytest.raises(SystemExit) as exited:
        cli.parse_command_line(["serve", *argv])
    assert exited.value.code == 2
    return capsys.readouterr().err


def test_a_config_files_options_reach_the_services_and_the_command_lines_flags_win(tmp_path):
    config = tmp_path / "serve.yaml"
    config.write_text(
        "model: smollm2-135m-instruct\n"
        "max_num_seqs: 4\n"  # underscores, as vLLM takes them
        "max-model-len: 512\n"
        "enforce-eager: true\n"
        "adaptive-speculation: false\n"  # a switch with a --no- form: given as such
        "enable-lora: false\n"  # off, which is what specserve does: nothing to say
        "served-model-name: [first, second]\n"
        "speculative-config: {method: ngram, num_speculative_tokens: 3}\n"
        "seed: null\n"
        "port: 8123\n")
    drafter, verifier, gateway = serve_plan("--config", str(config))
    assert flag(verifier.argv, "--model") == "smollm2-135m-instruct" == flag(gateway.argv, "--model")
    assert flag(verifier.argv, "--max-num-seqs") == "4" and flag(verifier.argv, "--max-model-len") == "512"
    assert "--enforce-eager" in verifier.argv and "--no-adaptive-speculation" in verifier.argv
    assert "--seed" not in verifier.argv
    assert gateway.argv[gateway.argv.index("--served-model-name") + 1:][:2] == ["first", "second"]
    spec = SpeculativeConfig.parse(flag(drafter.argv, "--speculative-config"))
    assert (spec.method, spec.num_speculative_tokens) == ("ngram", 3)
    assert gateway.port == 8123

    # the command line wins, whether its flag comes before --config or after, and its MODEL replaces the file's
    drafter, verifier, gateway = serve_plan("--port=9001", "--config", str(config), "--max_num_seqs", "2",
                                            "--adaptive-speculation", "qwen2.5-coder-0.5b-instruct")
    assert gateway.port == 9001 and flag(verifier.argv, "--max-num-seqs") == "2"
    assert "--adaptive-speculation" in verifier.argv and "--no-adaptive-speculation" not in verifier.argv
    assert flag(verifier.argv, "--model") == "qwen2.5-coder-0.5b-instruct"
    assert flag(verifier.argv, "--max-model-len") == "512"  # the file's still, where the command line is silent
    *_, gateway = serve_plan("--config", str(config), "--model", "qwen2.5-coder-0.5b-instruct")
    assert flag(gateway.argv, "--model") == "qwen2.5-coder-0.5b-instruct"


def test_a_config_file_that_cannot_be_used_is_refused_with_what_is_wrong(tmp_path, capsys):
    assert "No such file" in refusal(capsys, "--config", str(tmp_path / "missing.yaml"))
    cases = {
        "list.yaml": ("- model\n- port\n", "must map option names to values"),
        "broken.yaml": ("port: [\n", "is not a YAML file"),
        "nested.yaml": (f"config: {tmp_path / 'other.yaml'}\n", "give one file"),
        "value.yaml": ("port: eighty\n", "argument --port: invalid port_number value: 'eighty'"),
        "unknown.yaml": ("swap_space: 4\nmax-modle-len: 8\n",
                         "--swap-space (vLLM's) is not available: a request whose KV blocks"),
    }
    for name, (text, said) in cases.items():
        (tmp_path / name).write_text(text)
        err = refusal(capsys, "--config", str(tmp_path / name))
        assert said in err, (name, err)
        assert str(tmp_path / name) in err  # which file
    assert "did you mean --max-model-len?" in err


def test_vllm_flags_without_a_counterpart_say_why_and_a_misspelt_flag_names_the_one_meant(capsys):
    err = refusal(capsys, "--swap-space", "4", "--max-modl-len", "8", "--tokenizer", "other", "--underlined_typo_flag",
                  "--lora-modules=a=b", "stray")
    assert "--swap-space (vLLM's) is not available: a request whose KV blocks are taken back" in err
    assert "unrecognized argument --max-modl-len (did you mean --max-model-len?)" in err
    assert "--tokenizer (vLLM's) is not available: the tokenizer is always the model's own" in err
    assert "--lora-modules (vLLM's) is not available: LoRA adapters are not served" in err
    assert "unrecognized argument --underlined-typo-flag;" in err  # its name dashed, as every flag is read
    assert err.rstrip().endswith("unrecognized arguments: stray")  # a flag's value is not listed, a stray word is
    assert "8" not in err.split("(did you mean")[1].split(";")[0]


def test_flags_with_underscores_are_read_as_vllm_reads_them():
    args = cli.parse_command_line(["serve", "--max_num_seqs", "3", "--gpu_memory_utilization=0.5",
                                   "--tensor_parallel_size", "1", "--served_model_name", "x_y"])
    assert (args.max_num_seqs, args.gpu_memory_utilization, args.served_model_name) == (3, 0.5, ["x_y"])
    assert vllm_command_line.dashed(["--a_b=c_d", "e_f", "-x_y", "--"]) == ["--a-b=c_d", "e_f", "-x_y", "--"]


def test_no_flag_explained_as_missing_is_one_serve_has():
    """The table of vLLM flags without a counterpart never shadows a flag that works (one added later to serve
    must leave the table)."""
    args = cli.build_parsers()[1]
    assert not set(vllm_command_line.NOT_HERE) & set(vllm_command_line.option_strings(args))


def test_the_command_exits_2_with_the_reason_before_starting_anything():
    result = subprocess.run([sys.executable, "-m", "services.cli", "serve", "--swap-space", "4"], cwd=REPO,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert "specserve serve: error: --swap-space (vLLM's) is not available" in result.stderr


def test_download_dir_is_where_every_service_fetches_and_reads_models(tmp_path):
    for child in serve_plan("--download-dir", str(tmp_path / "models")):
        assert dict(child.env) == {"SPECSERVE_CACHE_DIR": str(tmp_path / "models")}, child.name
    assert all(child.env == () for child in serve_plan())  # unset: each service's own environment decides


def test_counts_are_read_as_vllm_writes_them(capsys):
    """vLLM's human_readable_int: lowercase suffixes decimal, uppercase binary; the verifier gets plain digits."""
    from services.common.human_counts import human_readable_int

    assert [human_readable_int(t) for t in ("4096", "32k", "32K", "25.6k", "1m", "2M", " 8k ")] == [
        4096, 32_000, 32_768, 25_600, 1_000_000, 2 * 2**20, 8_000]
    _, verifier, _ = serve_plan("--max-model-len", "4k", "--max_num_batched_tokens=2K")
    assert flag(verifier.argv, "--max-model-len") == "4000" and flag(verifier.argv, "--max-num-batched-tokens") == "2048"
    assert "a fraction needs a decimal suffix" in refusal(capsys, "--max-model-len", "1.5K")
    assert "'four' is not a count" in refusal(capsys, "--max-model-len", "four")
