"""A drafter that hangs under load: what it costs, measured as an operator would see it.

`specserve serve` (the default drafter) under CONCURRENCY streaming greedy chat requests. First a phase with
speculation off (`{"method": "none"}`) gives the baseline inter-token gap; then, with speculation on, the drafter
process is stopped with SIGSTOP for STALL_S (a GC pause, a full node or a partition look the same to the verifier)
and resumed with SIGCONT. Printed: the median inter-token gap (a streamed chunk of n tokens counts as n gaps
of 1/n of its wait, as vLLM's benchmarks count) in each phase and part of the stall
(before and after the circuit breaker opens), the ratio to no speculation, when /health said "degraded" and when
drafts were accepted again after the resume, failed requests, and outputs that differ from the no-speculation
ones (there must be none: exit 1 otherwise).

    python -m services.bench.drafter_stall [--stall-s 20] [--concurrency 8]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from services.bench.hardware import describe_hardware
from services.gateway.tokenizer import load_tokenizer
from services.modeling.registry import DEFAULT_MODEL
from services.soak.serve_process import ServeProcess
from services.soak.traffic import PROMPTS

NO_SPEC = {"method": "none"}


@dataclass
class Load:
    """CONCURRENCY threads each streaming one greedy chat request after another, with the speculative_config
    of the moment; every content chunk's arrival time is kept."""

    base_url: str
    model: str
    max_tokens: int
    tokenizer: object  # counts the tokens of a streamed chunk (a speculative step may deliver several)
    speculation: dict | None = None  # None: the server's default
    gaps: list[tuple[float, float]] = field(default_factory=list)  # (arrival time, inter-token gap)
    outputs: dict[int, set[str]] = field(default_factory=dict)  # by prompt index, speculation on
    reference: dict[int, str] = field(default_factory=dict)  # by prompt index, speculation off
    failures: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def run(self, worker: int) -> None:
        with httpx.Client(timeout=120) as client:
            index = worker
            while not self.stop.is_set():
                prompt = index % len(PROMPTS)
                index += 1
                self.one(client, prompt)

    def one(self, client: httpx.Client, prompt: int) -> None:
        speculation = self.speculation
        body = {"model": self.model, "messages": [{"role": "user", "content": PROMPTS[prompt]}], "stream": True,
                "max_tokens": self.max_tokens, "temperature": 0}
        if speculation is not None:
            body["speculative_config"] = speculation
        text, last = [], None
        try:
            with client.stream("POST", f"{self.base_url}/v1/chat/completions", json=body) as response:
                if response.status_code != 200:
                    response.read()
                    raise RuntimeError(f"status {response.status_code}: {response.text[:200]}")
                for line in response.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        raise RuntimeError(f"stream error: {event['error']}")
                    content = event["choices"][0]["delta"].get("content") if event.get("choices") else None
                    if content:
                        now = time.monotonic()
                        if last is not None:  # a chunk of n tokens: n inter-token gaps of 1/n of its wait
                            n = max(1, len(self.tokenizer.encode(content, add_special_tokens=False)))
                            with self.lock:
                                self.gaps.extend([(now, (now - last) / n)] * n)
                        last = now
                        text.append(content)
        except Exception as error:  # noqa: BLE001 - a failed request is a result to report
            with self.lock:
                self.failures.append(str(error))
            return
        with self.lock:
            if speculation == NO_SPEC:
                self.reference.setdefault(prompt, "".join(text))
            else:
                self.outputs.setdefault(prompt, set()).add("".join(text))

    def median_gap(self, start: float, end: float) -> float | None:
        with self.lock:
            window = [gap for at, gap in self.gaps if start <= at < end]
        return statistics.median(window) if window else None


def verifier_counter(serve: ServeProcess, name: str) -> float:
    text = httpx.get(serve.verifier_metrics_url, timeout=5).text
    return sum(float(line.rpartition(" ")[2]) for line in text.splitlines()
               if line.split("{")[0] == name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.bench.drafter_stall", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--stall-s", type=float, default=20.0)
    parser.add_argument("--phase-s", type=float, default=15.0, help="seconds of the no-speculation and warm phases")
    args = parser.parse_args(argv)

    print("hardware:", ", ".join(f"{k}: {v}" for k, v in describe_hardware().items()))
    log = Path(tempfile.mkdtemp(prefix="specserve-stall-")) / "serve.log"
    serve = ServeProcess(log, model=args.model, max_num_seqs=args.concurrency).start()
    load = Load(serve.base_url, args.model, args.max_tokens, load_tokenizer(args.model), NO_SPEC)
    threads = [threading.Thread(target=load.run, args=(i,), daemon=True) for i in range(args.concurrency)]
    try:
        started = time.monotonic()
        for thread in threads:
            thread.start()
        time.sleep(args.phase_s)
        none_window = (started + 2, time.monotonic())
        load.speculation = None  # the server's default drafter from the next request on
        time.sleep(args.phase_s)
        spec_window = (time.monotonic() - args.phase_s / 2, time.monotonic())
        drafter = serve.children()["drafter"]
        os.kill(drafter, signal.SIGSTOP)
        stopped = time.monotonic()
        degraded_at = None
        while time.monotonic() < stopped + args.stall_s:
            if degraded_at is None and serve.health()[1].get("drafters", [{}])[0].get("state") == "degraded":
                degraded_at = time.monotonic() - stopped
            time.sleep(0.1)
        accepted = verifier_counter(serve, "specserve_spec_decode_num_accepted_tokens_total")
        os.kill(drafter, signal.SIGCONT)
        resumed = time.monotonic()
        back_after = None
        while time.monotonic() < resumed + 30:
            if verifier_counter(serve, "specserve_spec_decode_num_accepted_tokens_total") > accepted:
                back_after = time.monotonic() - resumed
                break
            time.sleep(0.1)
        time.sleep(max(0.0, 8 - (time.monotonic() - resumed)))
    finally:
        load.stop.set()
        for thread in threads:
            thread.join(timeout=130)
        serve.stop()

    none_gap = load.median_gap(*none_window)
    rows = [("no speculation", none_window), ("speculation, drafter up", spec_window),
            ("stall, first 2 s", (stopped, stopped + 2)), ("stall, after 2 s", (stopped + 2, stopped + args.stall_s)),
            ("whole stall", (stopped, stopped + args.stall_s)), ("resume, first 2 s", (resumed, resumed + 2)),
            ("resume, 2-5 s", (resumed + 2, resumed + 5))]
    print(f"\n{args.concurrency} concurrent streaming greedy chats, {args.model}, "
          f"drafter SIGSTOPped {args.stall_s:.0f} s")
    print("| phase | median inter-token gap (ms) | vs no speculation |\n|---|---:|---:|")
    for name, window in rows:
        gap = load.median_gap(*window)
        ratio = f"{gap / none_gap:.2f}x" if gap and none_gap else "-"
        print(f"| {name} | {1e3 * gap:.1f} | {ratio} |" if gap else f"| {name} | - | - |")
    print(f"\n/health said degraded {degraded_at:.2f} s into the stall" if degraded_at is not None
          else "\n/health never said degraded")
    print(f"drafts accepted again {back_after:.2f} s after SIGCONT" if back_after is not None
          else "no draft accepted within 30 s of SIGCONT")
    differing = sum(1 for p, texts in load.outputs.items() if p in load.reference and texts != {load.reference[p]})
    print(f"failed requests: {len(load.failures)}; prompts whose speculative output differs: {differing} "
          f"of {len(load.outputs)}")
    for failure in load.failures[:5]:
        print("  failure:", failure)
    return 1 if differing or load.failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
