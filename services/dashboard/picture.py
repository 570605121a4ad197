"""The dashboard's picture from real traffic, in one command:

    python -m services.dashboard --out docs/deployment/dashboard.png

starts `specserve serve` (the default model, one drafter: ngram unless --method says otherwise) on free loopback
ports and a real Prometheus scraping its gateway, verifier and drafter every second, sends a few minutes of
mixed traffic through the OpenAI SDK (clients joining one by one up to more than the KV slots, streaming and
not, chat and completions, speculation on with the drafter's method or off with "none", code-edit prompts whose
answers copy the prompt so drafts get accepted, a few invalid requests and abandoned streams), then draws every
panel over the whole run (services.dashboard.render) and stops everything. Needs the test extra (openai) and
matplotlib.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from services.dashboard.prometheus import PrometheusServer, prometheus_binary
from services.dashboard.render import load_dashboard, render, summary
from services.soak.serve_process import HOST, ServeProcess
from services.soak.traffic import CODE, EDIT, MODEL

# (prompt, weight): mostly prompts whose answers copy them (drafts accepted), some open-ended ones.
PROMPTS = (
    (EDIT, 3),
    (f"Add type hints to this code and return it:\n\n{CODE}", 3),
    (f"Repeat this code exactly:\n\n{CODE}{CODE}", 2),
    ("Write a Python function that reverses a string.", 1),
    ("Name three rivers and one fact about each.", 1),
)


async def one_request(client, rng: random.Random, method: str) -> str:
    """Send one request of a random kind; returns its outcome's name."""
    import openai

    prompt = rng.choices([p for p, _ in PROMPTS], [w for _, w in PROMPTS])[0]
    spec = {"method": method if rng.random() < 0.7 else "none"}
    common = {"model": MODEL, "max_tokens": rng.randint(32, 96), "temperature": rng.choice([0, 0, 0.7]),
              "extra_body": {"speculative_config": spec}}
    kind = rng.choices(["chat_stream", "chat", "completion", "completion_stream", "abandoned", "invalid"],
                       [35, 25, 15, 15, 5, 5])[0]
    try:
        if kind == "invalid":
            common["temperature"] = -1  # a clean 400 in the HTTP requests panel
        if kind in ("chat", "invalid"):
            await client.chat.completions.create(messages=[{"role": "user", "content": prompt}], **common)
        elif kind == "completion":
            await client.completions.create(prompt=prompt, **common)
        elif kind == "completion_stream":
            async for _ in await client.completions.create(prompt=prompt, stream=True, **common):
                pass
        else:
            stream = await client.chat.completions.create(messages=[{"role": "user", "content": prompt}],
                                                          stream=True, **common)
            chunks = 0
            async for _ in stream:
                chunks += 1
                if kind == "abandoned" and chunks == 4:  # the client goes away: an aborted choice
                    await stream.close()
                    break
        return f"{kind} {spec['method']}"
    except openai.BadRequestError:
        return "400"
    except openai.APIError as error:
        return f"error {type(error).__name__}"


async def send_traffic(base_url: str, duration_s: float, clients: int, method: str, seed: int = 0) -> Counter:
    """`clients` concurrent clients, joining evenly over the first 40% of `duration_s`, each sending one
    request after another until the time is up."""
    import openai

    outcomes = Counter()
    deadline = time.monotonic() + duration_s
    async with openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0,
                                  timeout=300) as client:
        async def worker(index: int) -> None:
            rng = random.Random(seed * 1000 + index)
            await asyncio.sleep(index * 0.4 * duration_s / clients)
            while time.monotonic() < deadline:
                outcomes[await one_request(client, rng, method)] += 1

        await asyncio.gather(*(worker(i) for i in range(clients)))
    return outcomes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.dashboard", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("docs/deployment/dashboard.png"))
    parser.add_argument("--duration-s", type=float, default=180.0, help="how long traffic runs")
    parser.add_argument("--clients", type=int, default=10, help="concurrent clients at the peak")
    parser.add_argument("--method", default="ngram", help="the drafter's method (ngram, suffix)")
    parser.add_argument("--rate-interval", default="15s", help="what $__rate_interval stands for")
    parser.add_argument("--idle-s", type=float, default=10.0, help="quiet time drawn before and after traffic")
    parser.add_argument("--workdir", type=Path, help="keep the serve log and Prometheus data here")
    args = parser.parse_args(argv)
    prometheus_binary()  # fail before the model loads when there is none
    folder = args.workdir or Path(tempfile.mkdtemp(prefix="specserve-dashboard-"))
    folder.mkdir(parents=True, exist_ok=True)
    config = json.dumps({"method": args.method, "num_speculative_tokens": 5})
    serve = ServeProcess(folder / "serve.log", extra_flags=["--speculative-config", config])
    ports = serve.ports
    prometheus = PrometheusServer({"gateway": f"{HOST}:{ports.gateway}",
                                   "verifier": f"{HOST}:{ports.verifier_metrics}",
                                   "drafter": f"{HOST}:{ports.drafter_metrics}"}, folder)
    try:
        print(f"starting specserve serve (log {serve.log_path}) and Prometheus ({folder})", flush=True)
        serve.start()
        prometheus.start()
        start = prometheus.wait_for_scrapes_after(time.time())
        time.sleep(args.idle_s)
        print(f"sending {args.duration_s:.0f} s of traffic from up to {args.clients} clients", flush=True)
        outcomes = asyncio.run(send_traffic(serve.base_url, args.duration_s, args.clients, args.method))
        print("requests: " + ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items())), flush=True)
        time.sleep(args.idle_s)
        end = prometheus.wait_for_scrapes_after(time.time())
        dashboard = load_dashboard()
        series = render(prometheus.url, start, end, args.out, args.rate_interval, dashboard=dashboard)
    finally:
        prometheus.stop()
        serve.stop()
    print("\n".join(summary(dashboard, series)))
    print(f"wrote {args.out} ({args.out.stat().st_size / 1024:.0f} KiB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
