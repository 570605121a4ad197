"""`specserve serve` wires the three services' flags consistently: ports, speculation, metrics and TLS."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services import launcher, supervision
from services.common import drafter_methods
from services.modeling.eagle_heads import shipped_head

REPO = Path(__file__).resolve().parents[2]


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    launcher.add_arguments(parser)
    return parser.parse_args(list(argv))


def flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def test_default_plan_starts_drafter_verifier_gateway_with_their_ports():
    drafter, verifier, gateway = launcher.plan(parse())
    assert [c.name for c in (drafter, verifier, gateway)] == ["drafter", "verifier", "gateway"]
    assert (drafter.port, verifier.port, gateway.port) == (50061, 50051, 8000)
    assert flag(drafter.argv, "--metrics-port") == "8002" and flag(verifier.argv, "--metrics-port") == "8001"
    assert flag(verifier.argv, "--drafter") == "suffix=127.0.0.1:50061"  # make install builds arctic-inference
    assert json.loads(flag(drafter.argv, "--speculative-config")) == {"method": "suffix"}  # K: the default, 5
    assert flag(gateway.argv, "--verifier") == "127.0.0.1:50051"
    assert not any("tls" in arg or "cert" in arg for child in (drafter, verifier, gateway) for arg in child.argv)


def test_without_arctic_inference_serve_drafts_with_ngram_and_says_why(monkeypatch, capsys):
    real_build = drafter_methods.build_proposer

    def build(config):
        if config.method == "suffix":
            raise drafter_methods.MethodUnavailableError("needs the arctic-inference package")
        return real_build(config)

    monkeypatch.setattr(drafter_methods, "build_proposer", build)
    _, verifier, _ = launcher.plan(parse())
    assert flag(verifier.argv, "--drafter") == "ngram=127.0.0.1:50061"
    assert "not drafting with suffix: needs the arctic-inference package" in capsys.readouterr().err
    _, verifier, _ = launcher.plan(parse("--speculative-config", '{"method": "ngram"}'))  # asked for: no probing
    assert flag(verifier.argv, "--drafter") == "ngram=127.0.0.1:50061"


def test_unset_engine_flags_are_left_to_the_verifiers_settings_and_given_ones_pass_through():
    """SPECSERVE_VERIFIER_MAX_NUM_SEQS used to be overridden by serve's own --max-num-seqs default."""
    _, verifier, gateway = launcher.plan(parse())
    assert gateway.argv[2:4] == ["services.cli", "gateway"]
    for name in ("--model", "--device", "--dtype", "--max-num-seqs", "--max-model-len", "--compute-thread"):
        assert name not in verifier.argv and name not in gateway.argv
    _, verifier, gateway = launcher.plan(parse("--model", "qwen2.5-coder-0.5b-instruct", "--max-num-seqs", "3"))
    assert flag(verifier.argv, "--model") == "qwen2.5-coder-0.5b-instruct" == flag(gateway.argv, "--model")
    assert flag(verifier.argv, "--max-num-seqs") == "3"


def test_the_drafter_gets_the_whole_speculative_config_so_any_methods_options_reach_it():
    spec = '{"method": "suffix", "num_speculative_tokens": 12, "suffix_decoding_max_tree_depth": 32}'
    drafter, verifier, _ = launcher.plan(parse("--speculative-config", spec))
    sent = json.loads(flag(drafter.argv, "--speculative-config"))
    assert sent == {"method": "suffix", "num_speculative_tokens": 12, "suffix_decoding_max_tree_depth": 32}
    assert json.loads(flag(verifier.argv, "--speculative-config")) == sent
    assert flag(verifier.argv, "--drafter").startswith("suffix=")


def test_eagle_without_a_model_drafts_with_the_head_that_ships_for_the_target():
    drafter, verifier, _ = launcher.plan(parse("--speculative-config", '{"method": "eagle", "num_speculative_tokens": 4}'))
    sent = json.loads(flag(drafter.argv, "--speculative-config"))
    assert sent["model"] == str(shipped_head("smollm2-135m-instruct"))
    assert (Path(sent["model"]) / "model.safetensors").is_file() and (Path(sent["model"]) / "README.md").is_file()
    assert json.loads(flag(verifier.argv, "--speculative-config")) == sent
    with pytest.raises(ValueError, match="no EAGLE head ships for target 'qwen2.5-coder-1.5b-instruct'.*train-eagle"):
        launcher.plan(parse("--model", "qwen2.5-coder-1.5b-instruct", "--speculative-config", '{"method": "eagle"}'))
    given = '{"method": "eagle", "model": "/heads/mine"}'  # a head of the user's own is left alone
    drafter, _, _ = launcher.plan(parse("--speculative-config", given))
    assert json.loads(flag(drafter.argv, "--speculative-config"))["model"] == "/heads/mine"


def test_an_eagle3_head_shares_the_served_models_embedding_and_defaults_to_the_shipped_one():
    """A published head names its target by Hub id: the drafter is told to share the served --model's (unless the
    config says otherwise); eagle3 without a head drafts with the one that ships for the target, and a target with
    none is a usage error before anything starts."""
    given = '{"method": "eagle3", "model": "/heads/eagle3"}'
    drafter, verifier, _ = launcher.plan(parse("--model", "smollm2-135m-instruct", "--speculative-config", given))
    sent = json.loads(flag(drafter.argv, "--speculative-config"))
    assert sent == {"method": "eagle3", "model": "/heads/eagle3", "target_model": "smollm2-135m-instruct"}
    assert json.loads(flag(verifier.argv, "--speculative-config")) == sent
    own = '{"method": "eagle3", "model": "/heads/eagle3", "target_model": "/models/mine"}'
    drafter, _, _ = launcher.plan(parse("--model", "smollm2-135m-instruct", "--speculative-config", own))
    assert json.loads(flag(drafter.argv, "--speculative-config"))["target_model"] == "/models/mine"
    drafter, _, _ = launcher.plan(parse("--model", "smollm2-135m-instruct", "--speculative-config", '{"method": "eagle3"}'))
    sent = json.loads(flag(drafter.argv, "--speculative-config"))
    assert sent["model"] == str(shipped_head("smollm2-135m-instruct", "eagle3"))
    assert sent["target_model"] == "smollm2-135m-instruct"
    with pytest.raises(ValueError, match="no EAGLE-3 head ships for target 'qwen2.5-coder-1.5b-instruct'.*--eagle3"):
        launcher.plan(parse("--model", "qwen2.5-coder-1.5b-instruct", "--speculative-config", '{"method": "eagle3"}'))


def test_no_speculation_starts_no_drafter():
    children = launcher.plan(parse("--speculative-config", '{"method": "none"}'))
    assert [c.name for c in children] == ["verifier", "gateway"]
    assert "--drafter" not in children[0].argv


@pytest.mark.parametrize("root", [None, "/certs/ca.pem"])
def test_tls_reaches_every_link(root):
    argv = ["--tls-cert-file", "/certs/server.pem", "--tls-key-file", "/certs/server.key"]
    drafter, verifier, gateway = launcher.plan(parse(*argv, *(["--tls-root-cert", root] if root else [])))
    trusted = root or "/certs/server.pem"  # a self-signed certificate is its own root
    for server in (drafter, verifier):
        assert flag(server.argv, "--tls-cert-file") == "/certs/server.pem"
        assert flag(server.argv, "--tls-key-file") == "/certs/server.key"
    assert flag(verifier.argv, "--drafter-tls-root-cert") == trusted
    assert flag(gateway.argv, "--grpc-root-cert") == trusted


def test_half_a_tls_pair_is_refused():
    with pytest.raises(ValueError, match="go together"):
        launcher.plan(parse("--tls-cert-file", "/certs/server.pem"))


TCP_CHILD = (
    "import socket, sys, time; s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); "
    "s.bind(('127.0.0.1', int(sys.argv[1]))); s.listen(); time.sleep(600)"
)


def test_serve_restarts_a_killed_child_and_sigterm_stops_everything(tmp_path):
    """The real loop, as a process: two tiny TCP servers under `serve`; one is SIGKILLed and comes back on its
    port, then SIGTERM stops both and serve exits 0."""
    import os
    import signal

    from tests.ports import free_port

    ports = [free_port(), free_port()]
    script = (
        "import sys\nfrom services import launcher, supervision\n"
        f"children = [supervision.Child(n, [sys.executable, '-c', {TCP_CHILD!r}, str(p)], '127.0.0.1', p) "
        f"for n, p in (('drafter', {ports[0]}), ('gateway', {ports[1]}))]\n"
        "policy = supervision.RestartPolicy(initial_backoff_s=0.2, max_backoff_s=1.0)\n"
        "raise SystemExit(launcher.serve(children, policy, start_timeout_s=30, tick_s=0.05))\n"
    )
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        serve = subprocess.Popen([sys.executable, "-c", script], stdout=out, stderr=subprocess.STDOUT)

    def wait_for_line(text: str, timeout_s: float = 20.0) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in log.read_text().splitlines():
                if text in line:
                    return line
            time.sleep(0.05)
        raise AssertionError(f"no {text!r} in:\n{log.read_text()}")

    try:
        first = int(wait_for_line("drafter is listening on").rsplit("pid ", 1)[1].rstrip(")"))
        gateway = int(wait_for_line("gateway is listening on").rsplit("pid ", 1)[1].rstrip(")"))
        os.kill(first, signal.SIGKILL)
        wait_for_line(f"drafter (pid {first}) exited with code -9")
        again = wait_for_line("drafter is listening again")
        second = int(again.split("pid ")[1].split(",")[0])
        assert second != first and supervision.port_is_open("127.0.0.1", ports[0])
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(timeout=30) == 0
        assert "restarts: drafter 1, gateway 0" in log.read_text()
        for pid in (second, gateway):  # both children are gone (reaped by serve, so no such process)
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait()


def test_a_child_that_dies_during_start_up_fails_fast(capsys):
    child = supervision.Child("verifier", [__import__("sys").executable, "-c", "raise SystemExit(3)"], "127.0.0.1", 9)
    code = launcher.serve([child], supervision.RestartPolicy(), start_timeout_s=30)
    assert code == 1
    error = capsys.readouterr().err
    assert "verifier did not start: process exited with code 3 before listening on 127.0.0.1:9" in error


def test_a_port_something_else_listens_on_fails_the_start_before_any_child_starts(monkeypatch, capsys):
    """A gateway that cannot bind its port exits and was restarted forever, and the launcher, waiting for the port
    to open, took the other process listening there for the child started."""
    import socket

    started = []
    monkeypatch.setattr(launcher, "serve", lambda children, *a, **k: started.append(children) or 0)
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        busy = other.getsockname()[1]
        assert launcher.run(parse("--port", str(busy), "--verifier-port", "0", "--drafter-port", "0",
                                  "--verifier-metrics-port", "0", "--drafter-metrics-port", "0")) == 1
        assert f"port {busy} on 127.0.0.1 (--port) is in use" in capsys.readouterr().err
        assert launcher.run(parse("--port", "0", "--verifier-port", "0", "--drafter-port", str(busy),
                                  "--verifier-metrics-port", "0", "--drafter-metrics-port", "0",
                                  "--speculative-config", '{"method": "none"}')) == 0  # no drafter: not its port
    free, *others = (str(port) for port in supervision.free_ports(4))  # the others named too: a port the launcher
    # picked for one of them could be `free` again, and the clash it reports another
    assert launcher.run(parse("--port", free, "--verifier-metrics-port", free, "--verifier-port", others[0],
                              "--drafter-port", others[1], "--drafter-metrics-port", others[2])) == 1
    assert "--port and --verifier-metrics-port both name port" in capsys.readouterr().err
    assert len(started) == 1


def test_the_engine_flags_are_declared_once_for_verifier_serve_and_generate():
    from services.cli import build_parser
    from services.verifier.main import add_verifier_flags

    given = ["--model", "m", "--device", "cpu", "--dtype", "float32", "--max-num-seqs", "2", "--max-model-len", "64",
             "--max-num-batched-tokens", "32"]
    verifier_parser = argparse.ArgumentParser()
    add_verifier_flags(verifier_parser)
    verifier = verifier_parser.parse_args(given)
    generate = build_parser().parse_args(["generate", *given])
    _, planned, _ = launcher.plan(parse(*given))
    for name, value in zip(given[::2], given[1::2], strict=True):
        dest = name[2:].replace("-", "_")
        assert str(getattr(verifier, dest)) == value == str(getattr(generate, dest)) == flag(planned.argv, name)


def test_serve_passes_adaptive_speculation_on_and_off_to_the_verifier_only_when_given():
    from services.verifier.main import add_verifier_flags
    from services.verifier.settings import VerifierSettings

    for given, expected in ((["--no-adaptive-speculation"], False), (["--adaptive-speculation"], True)):
        _, planned, _ = launcher.plan(parse(*given))
        assert given[0] in planned.argv
        verifier_parser = argparse.ArgumentParser()
        add_verifier_flags(verifier_parser)
        assert verifier_parser.parse_args(given).adaptive_speculation is expected
    _, planned, _ = launcher.plan(parse())
    assert not any("adaptive-speculation" in arg for arg in planned.argv)  # the verifier's default holds
    assert VerifierSettings().adaptive_speculation is True


def test_service_ports_given_as_zero_become_free_ports_named_consistently():
    """`--drafter-port 0` used to hang: the launcher waited for port 0 to listen."""
    args = launcher.with_free_ports(parse("--port", "0", "--verifier-port", "0", "--drafter-port", "0",
                                          "--drafter-metrics-port", "0"))
    drafter, verifier, gateway = launcher.plan(args)
    ports = (drafter.port, verifier.port, gateway.port)
    assert 0 not in ports and len(set(ports)) == 3
    assert flag(drafter.argv, "--port") == str(drafter.port)
    assert flag(verifier.argv, "--drafter").endswith(f":{drafter.port}")
    assert flag(gateway.argv, "--verifier").endswith(f":{verifier.port}")
    assert flag(drafter.argv, "--metrics-port") == "0"  # a metrics port 0 means no endpoint, not a free port
    banner = launcher._banner(args, [drafter, verifier, gateway])
    assert f"drafter gRPC 127.0.0.1:{drafter.port}, metrics off" in banner  # not "http://127.0.0.1:0/metrics"
    assert "verifier gRPC" in banner and ":8001/metrics" in banner
    assert launcher.plan(launcher.with_free_ports(parse()))[0].port == 50061  # given ports stay


@pytest.mark.parametrize("port", ["-5", "65536"])
def test_a_port_out_of_range_is_a_usage_error(port, capsys):
    with pytest.raises(SystemExit):
        parse("--drafter-port", port)
    assert "is not a port number" in capsys.readouterr().err


def test_max_logprobs_reaches_the_verifier_when_given():
    _, verifier, _ = launcher.plan(parse("--max-logprobs", "50"))
    assert flag(verifier.argv, "--max-logprobs") == "50"
    assert flag(launcher.plan(parse())[1].argv, "--max-logprobs") is None


def test_graph_flags_reach_the_verifier_settings_as_vllm_spells_them():
    from services.verifier.main import add_verifier_flags
    from services.verifier.settings import VerifierSettings

    given = ["--enforce-eager", "--cuda-graph-sizes", "1", "4", "2"]
    _, verifier, _ = launcher.plan(parse(*given))
    index = verifier.argv.index("--cuda-graph-sizes")
    assert "--enforce-eager" in verifier.argv and verifier.argv[index + 1 : index + 4] == ["1", "4", "2"]
    verifier_parser = argparse.ArgumentParser()
    add_verifier_flags(verifier_parser)
    settings = VerifierSettings(**vars(verifier_parser.parse_args(given)))
    assert settings.graphs.enforce_eager and settings.graphs.capture_sizes == (1, 2, 4)
    assert VerifierSettings().graphs.capture_sizes is None and not VerifierSettings().graphs.enforce_eager
    assert not any("graph" in arg or "eager" in arg for arg in launcher.plan(parse())[1].argv)
    with pytest.raises(ValueError, match="cuda_graph_sizes"):
        VerifierSettings(cuda_graph_sizes=[0, 2])


def test_a_model_drafter_follows_the_verifiers_device_and_batch_unless_its_config_says_otherwise():
    def drafter_config(*argv: str) -> dict:
        drafter = next(child for child in launcher.plan(parse(*argv)) if child.name == "drafter")
        return json.loads(flag(drafter.argv, "--speculative-config"))

    pair = '{"method": "draft_model", "model": "qwen2.5-coder-0.5b-instruct", "num_speculative_tokens": 4}'
    sent = drafter_config("--device", "cuda", "--dtype", "bfloat16", "--speculative-config", pair)
    assert (sent["draft_device"], sent["draft_dtype"]) == ("cuda", "bfloat16")
    placed = pair.replace('"num_speculative_tokens"', '"draft_device": "cpu", "num_speculative_tokens"')
    sent = drafter_config("--device", "cuda", "--speculative-config", placed)
    assert sent["draft_device"] == "cpu" and "draft_dtype" not in sent
    assert "draft_device" not in drafter_config("--speculative-config", pair)  # no --device: the drafter's auto
    eagle = drafter_config("--device", "cuda:1", "--speculative-config", '{"method": "eagle"}')
    assert eagle["draft_device"] == "cuda:1" and "draft_dtype" not in eagle
    assert "draft_device" not in drafter_config("--device", "cuda", "--speculative-config", '{"method": "ngram"}')
    # as many sequences as the verifier runs, eager with it (graphs captured for each row count otherwise)
    sent = drafter_config("--max-num-seqs", "64", "--enforce-eager", "--speculative-config", '{"method": "eagle"}')
    assert (sent["draft_max_num_seqs"], sent["enforce_eager"]) == (64, True)
    sent = drafter_config("--max-num-seqs", "64", "--no-enforce-eager", "--speculative-config",
                          pair.replace('"num_speculative_tokens"', '"draft_max_num_seqs": 4, "num_speculative_tokens"'))
    assert sent["draft_max_num_seqs"] == 4 and "enforce_eager" not in sent


def test_verifier_and_drafter_can_be_placed_on_cpu_sets():
    """taskset's list syntax, within the launcher's own CPUs; the gateway is not pinned."""
    mine = sorted(supervision.os.sched_getaffinity(0))
    first, last = mine[0], mine[-1]
    everything = ",".join(map(str, reversed(mine)))  # the launcher's own CPUs, in any order
    drafter, verifier, gateway = launcher.plan(parse("--verifier-cpus", everything, "--drafter-cpus", str(last)))
    assert verifier.cpus == tuple(mine) and drafter.cpus == (last,) and gateway.cpus == ()
    assert launcher.plan(parse())[1].cpus == ()
    assert supervision.parse_cpu_list(f"{last}-{last}, {first},{first}") == tuple(sorted({first, last}))  # merged
    for bad, why in (("x", "not a CPU list"), ("3-1", "backwards"), (str(last + 1000), "not available here")):
        with pytest.raises(ValueError, match=why):
            supervision.parse_cpu_list(bad)
        with pytest.raises(SystemExit):
            parse("--verifier-cpus", bad)


@pytest.mark.skipif(sys.platform != "linux", reason="CPU placement is Linux's sched_setaffinity")
def test_a_placed_child_runs_on_its_cpus_only_and_torch_follows():
    cpu = max(supervision.os.sched_getaffinity(0))
    code = "import os, torch; print(sorted(os.sched_getaffinity(0)), torch.get_num_threads())"
    child = supervision.Child("placed", [sys.executable, "-c", code], "127.0.0.1", 0, (cpu,))
    out = subprocess.run([sys.executable, "-c", (
        "import sys; from services.supervision import Child, spawn_child\n"
        f"process = spawn_child(Child(*{[child.name, child.argv, child.host, child.port, child.cpus]!r}))\n"
        "raise SystemExit(process.wait())")], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [f"[{cpu}]", "1"], out.stdout


def test_a_vllm_serve_command_line_runs_as_it_is():
    """`vllm serve MODEL --served-model-name NAME --seed N --enable-auto-tool-choice --tool-call-parser hermes` as users
    already type it: the model as the verifier's and the gateway's --model, the names and the tool-call parser to the
    gateway, the seed to the verifier; tool calls are always on."""
    args = launcher.with_model_tag(parse("qwen2.5-coder-0.5b-instruct", "--served-model-name", "coder", "org/coder",
                                         "--seed", "7", "--enable-auto-tool-choice", "--tool-call-parser", "hermes"))
    _, verifier, gateway = launcher.plan(args)
    assert flag(gateway.argv, "--tool-call-parser") == "hermes" and "--enable-auto-tool-choice" not in gateway.argv
    assert flag(verifier.argv, "--model") == "qwen2.5-coder-0.5b-instruct" == flag(gateway.argv, "--model")
    names = gateway.argv.index("--served-model-name")
    assert gateway.argv[names + 1 : names + 3] == ["coder", "org/coder"] and "--served-model-name" not in verifier.argv
    assert flag(verifier.argv, "--seed") == "7" and "--seed" not in gateway.argv
    same = launcher.with_model_tag(parse("smollm2-135m-instruct", "--model", "smollm2-135m-instruct"))
    assert same.model == "smollm2-135m-instruct"
    with pytest.raises(ValueError, match="given twice"):
        launcher.with_model_tag(parse("smollm2-135m-instruct", "--model", "qwen2.5-coder-0.5b-instruct"))
    _, verifier, gateway = launcher.plan(launcher.with_model_tag(parse()))
    assert not {"--model", "--seed", "--served-model-name", "--tool-call-parser"} & set(verifier.argv + gateway.argv)


@pytest.mark.parametrize("argv", [["-tp", "1"], ["--tensor-parallel-size", "01"], ["-pp", "1"],
                                  ["--kv-cache-dtype", "auto"], ["--enable-chunked-prefill"]])
def test_vllm_flags_at_the_one_value_that_runs_here_are_taken(argv):
    """`-tp 1`, `--kv-cache-dtype auto`, `--enable-chunked-prefill`: what serve does anyway, so a vLLM command line
    keeps them; the services' command lines do not change."""
    assert [child.argv for child in launcher.plan(parse(*argv))] == [child.argv for child in launcher.plan(parse())]


@pytest.mark.parametrize(("argv", "says"), [
    (["-tp", "2"], "one device"), (["--pipeline-parallel-size", "4"], "one device"),
    (["--kv-cache-dtype", "fp8"], "dtype"), (["--no-enable-chunked-prefill"], "max-num-batched-tokens"),
])
def test_vllm_flags_at_a_value_that_would_be_ignored_are_refused(argv, says, capsys):
    with pytest.raises(SystemExit) as exit_:
        parse(*argv)
    assert exit_.value.code == 2 and says in capsys.readouterr().err


def test_a_chat_template_reaches_the_gateway_only():
    _, verifier, gateway = launcher.plan(parse("--chat-template", "./template.jinja"))
    assert flag(gateway.argv, "--chat-template") == "./template.jinja" and "--chat-template" not in verifier.argv


def test_gpu_memory_utilization_reaches_the_verifiers_kv_cache():
    from services.verifier.settings import VerifierSettings

    _, verifier, _ = launcher.plan(parse("--gpu-memory-utilization", "0.85"))
    assert flag(verifier.argv, "--gpu-memory-utilization") == "0.85"
    assert VerifierSettings(gpu_memory_utilization=0.85).kv_cache.memory_utilization == 0.85
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        VerifierSettings(gpu_memory_utilization=1.2)


def test_every_engine_and_gateway_flag_declared_reaches_the_service_it_is_for():
    """serve passes on ENGINE_FLAGS and GATEWAY_FLAGS and generate reads LOCAL_ENGINE_FLAGS: a flag declared by
    add_engine_flags (add_cors_flags, add_logging_flags) and missing from its list would be accepted and silently
    ignored."""
    from services import cli
    from services.gateway.settings import add_cors_flags, add_https_flags, add_logging_flags, add_root_path_flag
    from services.verifier.settings import add_engine_flags

    def declared(**options) -> set[str]:
        parser = argparse.ArgumentParser()
        add_engine_flags(parser, default=None, **options)
        return {action.dest for action in parser._actions if action.dest != "help"}

    assert declared() == set(launcher.ENGINE_FLAGS)
    assert declared(compute_thread=False, serving=False) == set(cli.LOCAL_ENGINE_FLAGS)
    gateway = argparse.ArgumentParser()
    add_cors_flags(gateway)
    add_logging_flags(gateway)
    add_https_flags(gateway)
    add_root_path_flag(gateway)
    names = {action.dest for action in gateway._actions} - {"help", "disable_log_requests"}  # nothing to turn off
    assert names <= set(launcher.GATEWAY_FLAGS)
    switches, argv = {"allow_credentials", "disable_uvicorn_access_log", "trust_remote_code", "enable_log_requests"}, []
    values = {"max_log_len": "100", "root_path": "/prefix"}
    for name in launcher.GATEWAY_FLAGS:
        argv += [f"--{name.replace('_', '-')}", *([] if name in switches else [values.get(name, "info")])]
    planned = launcher.plan(parse(*argv))[2]
    assert all(f"--{name.replace('_', '-')}" in planned.argv for name in launcher.GATEWAY_FLAGS)


def test_https_flags_reach_the_gateway_only_and_the_banner_says_https():
    argv = ["--ssl-keyfile", "/certs/api.key", "--ssl-certfile", "/certs/api.pem"]
    children = launcher.plan(parse(*argv))
    _, verifier, gateway = children
    assert flag(gateway.argv, "--ssl-keyfile") == "/certs/api.key"
    assert flag(gateway.argv, "--ssl-certfile") == "/certs/api.pem"
    assert not any("ssl" in arg for arg in verifier.argv + children[0].argv)
    assert "POST https://127.0.0.1:8000/v1/completions" in launcher._banner(parse(*argv), children)
    assert "POST http://127.0.0.1:8000/v1/completions" in launcher._banner(parse(), launcher.plan(parse()))
    with pytest.raises(ValueError, match="go together"):  # before the verifier loads its model
        launcher.plan(parse("--ssl-certfile", "/certs/api.pem"))


def test_generation_config_reaches_the_gateway_only():
    _, verifier, gateway = launcher.plan(parse("--generation-config", "vllm"))
    assert flag(gateway.argv, "--generation-config") == "vllm" and "--generation-config" not in verifier.argv


def test_root_path_reaches_the_gateway_only():
    _, verifier, gateway = launcher.plan(parse("--root-path", "/specserve"))
    assert flag(gateway.argv, "--root-path") == "/specserve" and "--root-path" not in verifier.argv


def test_trust_remote_code_reaches_the_verifier_and_the_gateway_which_load_the_model_and_its_tokenizer():
    drafter, verifier, gateway = launcher.plan(parse("--trust-remote-code"))
    assert "--trust-remote-code" in verifier.argv and "--trust-remote-code" in gateway.argv
    assert "--trust-remote-code" not in drafter.argv
    assert not any("trust" in arg for child in launcher.plan(parse()) for arg in child.argv)


def test_cors_flags_reach_the_gateway_only():
    _, verifier, gateway = launcher.plan(parse("--allowed-origins", '["*"]', "--allow-credentials"))
    assert flag(gateway.argv, "--allowed-origins") == '["*"]' and "--allow-credentials" in gateway.argv
    assert not any("allow" in arg for arg in verifier.argv)
    assert not any("allow" in arg for arg in launcher.plan(parse())[2].argv)


def test_vllms_logging_flags_reach_the_service_that_logs():
    from services.gateway.main import parse_args
    from services.verifier.main import add_verifier_flags
    from services.verifier.settings import VerifierSettings

    _, verifier, gateway = launcher.plan(parse("--disable-log-stats", "--disable-log-requests",
                                               "--uvicorn-log-level", "warning", "--disable-uvicorn-access-log"))
    assert "--disable-log-stats" in verifier.argv and "--disable-log-stats" not in gateway.argv
    assert flag(gateway.argv, "--uvicorn-log-level") == "warning" and "--disable-uvicorn-access-log" in gateway.argv
    assert "--disable-log-requests" not in verifier.argv + gateway.argv  # nothing to turn off
    verifier_parser = argparse.ArgumentParser()
    add_verifier_flags(verifier_parser)
    assert VerifierSettings(**vars(verifier_parser.parse_args(["--disable-log-stats"]))).log_stats_interval_s == 0
    assert VerifierSettings(**vars(verifier_parser.parse_args([]))).log_stats_interval_s > 0
    settings = parse_args(["--uvicorn-log-level", "warning", "--disable-uvicorn-access-log", "--disable-log-requests"])
    assert settings.uvicorn_log_level == "warning" and settings.disable_uvicorn_access_log
    assert parse_args([]).uvicorn_log_level == "info" and not parse_args([]).disable_uvicorn_access_log
    _, verifier, gateway = launcher.plan(parse())
    assert not any("log" in arg for arg in verifier.argv + gateway.argv)
