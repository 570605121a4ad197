"""The metrics and the Grafana dashboard against a real Prometheus: the shared e2e stack (SmolLM2-135M, an n-gram
drafter, as real processes) runs, Prometheus scrapes its gateway, verifier and drafter every second, the OpenAI
SDK sends greedy requests, and then

- PromQL over the test window gives exactly the acceptance rate and mean acceptance length that the responses'
  `speculative_decoding` stats add up to (counter differences with `@`, and the dashboard's own rate() ratios
  over a range covering the window);
- every query of every dashboard panel (template variables and $__rate_interval filled in) parses and returns
  data, and every template variable lists the values this stack has.

No Prometheus binary is a failure, not a skip: `make test` installs it (deploy/scripts/install-test-tools.sh).
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Callable
from dataclasses import dataclass

import openai
import pytest

from services.dashboard.prometheus import PrometheusServer, PromQLError, finite_values, prometheus_binary
from services.dashboard.render import load_dashboard, substitute
from services.soak.serve_process import HOST
from tests.e2e.requests import CODE, EDIT, MODEL, NO_SPEC, at_once
from tests.ports import free_port

pytestmark = pytest.mark.slow

SPEC_FIELDS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


@dataclass
class Observed:
    prometheus: PrometheusServer
    model: str  # the model_name label: the served model
    first_scrape_before: float  # Unix time before Prometheus started (no sample is older)
    before_requests: float  # every target scraped after this, and no request sent yet
    after_requests: float  # every target scraped after the last response
    totals: dict[str, int]  # the responses' speculative_decoding stats, summed

    @property
    def window(self) -> str:
        """A range reaching back past the first scrape: rate() over it covers the whole test."""
        return f"{math.ceil(self.after_requests - self.first_scrape_before) + 5}s"


def send_requests(base_url: str, after_first: Callable[[], object]) -> dict[str, int]:
    """Greedy requests as users send them (chat, completions, streaming), drafting with ngram on prompts whose
    answers copy the prompt, plus one without speculation; returns the ngram requests' stats summed. The first
    one goes alone, then `after_first` (a scrape), then the rest together: a series is born with its first
    observation, and rate() counts only what grows after a series' first sample, so a panel shows data only if
    some requests end after a scrape has seen the series."""
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=300)
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": EDIT}], max_tokens=48,
                                            temperature=0, stream=True, stream_options={"include_usage": True})
    stats = [list(stream)[-1].model_extra["speculative_decoding"]]
    after_first()

    def chat(content: str):
        return lambda: client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": content}],
                                                      max_tokens=64, temperature=0)

    *replies, plain = at_once(
        chat(EDIT), chat(f"Add type hints to this code and return it:\n\n{CODE}"),
        lambda: client.completions.create(model=MODEL, prompt=CODE + CODE, max_tokens=48, temperature=0),
        lambda: client.completions.create(model=MODEL, prompt=CODE, max_tokens=16, temperature=0, extra_body=NO_SPEC))
    stats += [reply.model_extra["speculative_decoding"] for reply in replies]
    assert plain.model_extra["speculative_decoding"]["num_drafts"] == 0
    assert {s["method"] for s in stats} == {"ngram"}
    return {name: sum(s[name] for s in stats) for name in SPEC_FIELDS}


@pytest.fixture(scope="module")
def observed(shared_stack, tmp_path_factory):
    """Prometheus scraping the shared stack, which this module is the first to use (tests/e2e/stack.py), so its
    counters start at 0 as on a fresh `specserve serve`."""
    prometheus_binary()  # fail before minutes of model loading when there is none
    stack = shared_stack
    prometheus = PrometheusServer({"gateway": f"{HOST}:{stack.gateway_port}",
                                   "verifier": f"{HOST}:{stack.verifier_metrics_port}",
                                   "drafter": f"{HOST}:{stack.drafter_metrics_port}"},
                                  tmp_path_factory.mktemp("prometheus"), port=free_port())
    try:
        started = time.time()
        prometheus.start()
        before = prometheus.wait_for_scrapes_after(time.time())
        totals = send_requests(stack.base_url, lambda: prometheus.wait_for_scrapes_after(time.time()))
        after = prometheus.wait_for_scrapes_after(time.time())
        model = openai.OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused").models.list().data[0].id
        yield Observed(prometheus, model, started, before, after, totals)
    finally:
        prometheus.stop()


def test_promql_acceptance_equals_the_responses_stats(observed):
    totals = observed.totals
    assert totals["num_accepted_tokens"] > 0, "ngram accepted nothing: the test checks nothing"
    prometheus, at = observed.prometheus, observed.after_requests

    def over_test(metric: str) -> str:
        """The counter's growth during the test (a series born mid-test counts from 0)."""
        selector = f'{metric}{{model_name="{observed.model}", method="ngram"}}'
        return f"(sum({selector}) - (sum({selector} @ {observed.before_requests:.3f}) or vector(0)))"

    for name in SPEC_FIELDS:  # the verifier counts every step; the gateway sums the requests it answered
        assert prometheus.value(over_test(f"specserve_spec_decode_{name}_total"), at) == totals[name], name
        assert prometheus.value(over_test(f"specserve_gateway_spec_decode_{name}_total"), at) == totals[name]

    accepted, drafted, drafts = (over_test(f"specserve_spec_decode_{n}_total") for n in
                                 ("num_accepted_tokens", "num_draft_tokens", "num_drafts"))
    expected_rate = totals["num_accepted_tokens"] / totals["num_draft_tokens"]
    expected_length = 1 + totals["num_accepted_tokens"] / totals["num_drafts"]
    assert prometheus.value(f"{accepted} / {drafted}", at) == pytest.approx(expected_rate, rel=1e-12)
    assert prometheus.value(f"1 + {accepted} / {drafts}", at) == pytest.approx(expected_length, rel=1e-12)

    # The dashboard's panels divide rate()s of counters scraped together, so over a range covering the test
    # (counters at 0 when it starts) their ratio is the exact one too.
    panels = {panel["title"]: panel for panel in load_dashboard()["panels"]}
    for title, expected in (("Acceptance rate", expected_rate), ("Mean acceptance length", expected_length)):
        (target,) = panels[title]["targets"]
        result = prometheus.query(concrete(target["expr"], observed), at)
        assert [(r["metric"]["method"], float(r["value"][1])) for r in result] == [
            ("ngram", pytest.approx(expected, rel=1e-9))
        ], title


def test_every_dashboard_query_parses_and_returns_data(observed):
    problems = []
    panels = [panel for panel in load_dashboard()["panels"] if panel["type"] != "row"]
    assert len(panels) >= 15
    for panel in panels:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        for target in panel["targets"]:
            assert "[$__rate_interval]" in target["expr"] or "rate(" not in target["expr"], target["expr"]
            expr = concrete(target["expr"], observed)
            try:
                result = observed.prometheus.query(expr, observed.after_requests)
            except PromQLError as error:
                problems.append(f"{panel['title']}: {error}")
                continue
            if not finite_values(result):
                problems.append(f"{panel['title']}: no data from {expr!r}: {result}")
    assert not problems, "\n".join(problems)


def test_template_variables_list_this_stack(observed):
    variables = {v["name"]: v for v in load_dashboard()["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    expected = {"model": {observed.model}, "method": {"ngram"},
                "instance": {target for target in observed.prometheus.targets.values()}}
    for name, wanted in expected.items():
        match = re.fullmatch(r"label_values\((.+), (\w+)\)", variables[name]["query"]["query"])
        assert match, variables[name]
        selector, label = match.groups()
        result = observed.prometheus.query(f"count by ({label}) ({selector})", observed.after_requests)
        assert {r["metric"][label] for r in result} >= wanted, name


def concrete(expr: str, observed: Observed) -> str:
    """What Grafana sends for `expr` with model and method chosen, All instances and a rate interval spanning
    the test; an unknown variable is a KeyError (the dashboard would show it unreplaced)."""
    values = {"model": observed.model, "method": "ngram", "instance": ".*", "__rate_interval": observed.window}
    return substitute(expr, values)
