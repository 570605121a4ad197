"""A drafter method from outside the repository, served end to end by `specserve serve`.

The throwaway method (tests/plugins.py) is installed as a package would install one: a module and an entry point
in the group "specserve.drafter_methods", found on PYTHONPATH. No other file knows its name; `--speculative-config`
names it, the launcher starts a drafter that builds it, the verifier drafts with it, and greedy output through
the OpenAI SDK equals the output without speculation."""

from __future__ import annotations

import json

import openai
import pytest

from services.soak.serve_process import ServeProcess
from tests.e2e.requests import EDIT, MODEL, NO_SPEC, at_once
from tests.e2e.stack import serve_ports
from tests.plugins import THROWAWAY_METHOD, install_throwaway_method


@pytest.fixture(scope="module")
def plugin_stack(tmp_path_factory):
    folder = install_throwaway_method(tmp_path_factory.mktemp("plugin"))
    spec = json.dumps({"method": THROWAWAY_METHOD, "num_speculative_tokens": 4})
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("PYTHONPATH", str(folder))
        stack = ServeProcess(tmp_path_factory.mktemp("logs") / "serve.log", extra_flags=["--speculative-config", spec],
                             ports=serve_ports())
        try:
            yield stack.start()
        finally:
            stack.stop()


def test_a_plugin_method_drafts_end_to_end_without_changing_greedy_output(plugin_stack):
    client = openai.OpenAI(base_url=f"{plugin_stack.base_url}/v1", api_key="unused")
    messages = [{"role": "user", "content": EDIT}]  # the answer copies the code: a 1-gram lookup drafts well
    drafted, plain = at_once(
        lambda: client.chat.completions.create(model=MODEL, messages=messages, max_tokens=60, temperature=0),
        lambda: client.chat.completions.create(model=MODEL, messages=messages, max_tokens=60, temperature=0,
                                               extra_body=NO_SPEC))
    assert drafted.choices[0].message.content == plain.choices[0].message.content
    spec = drafted.model_extra["speculative_decoding"]
    assert spec["method"] == THROWAWAY_METHOD and spec["num_drafts"] > 0, spec
    assert f"drafter ({THROWAWAY_METHOD}) listening" in plugin_stack.log()
