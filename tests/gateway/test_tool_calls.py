"""Tool calls: the Hermes parser whole and streamed (tags split anywhere), the conversation rendered with tools
(a template that knows them and one that does not), the OpenAI SDK's tool_calls and their streamed deltas from
a scripted verifier, tool_choice none/auto/required/named, and the grammar that forces a call (checked with
llguidance itself: it accepts a valid call and refuses another name or bad arguments)."""

from __future__ import annotations

import json
from functools import partial

import httpx
import llguidance
import llguidance.hf
import openai
import pytest

from services.gateway.app import create_app
from services.gateway.settings import GatewaySettings
from services.gateway.tools import hermes
from services.gateway.tools.grammar import forced_call_grammar
from services.gateway.tools.parsers import tool_call_format
from services.gateway.tools.schemas import ToolDef
from tests.gateway.fakes import byte_tokenizer

MODEL = "tiny-test"
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                           "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def test_hermes_parse_splits_content_and_calls():
    content, calls = hermes.parse("Let me check." + CALL + "\n" + CALL.replace("Paris", "Oslo"))
    assert content.strip() == "Let me check."
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo"})]
    assert all(c.id.startswith("call_") for c in calls) and calls[0].id != calls[1].id
    for broken in ("<tool_call>\nnot json\n</tool_call>", '<tool_call>{"arguments": {}}</tool_call>',
                   "<tool_call>\n{\"name\": \"f\"", "a < b and <tool"):
        assert hermes.parse(broken) == (broken, [])  # not a call: stays content, never an error


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_hermes_stream_equals_whole_parse_wherever_the_text_is_cut(size):
    text = "Sure <b>bold</b> " + CALL + " done <tool"
    stream = hermes.HermesStream()
    deltas = []
    for start in range(0, len(text), size):
        deltas += stream.feed(text[start:start + size])
    deltas += stream.finish()
    content = "".join(d.content or "" for d in deltas)
    calls = [d.tool_call for d in deltas if d.tool_call]
    whole_content, whole_calls = hermes.parse(text)
    assert content == whole_content and "<tool_call>" not in content
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        (c.function.name, c.function.arguments) for c in whole_calls]


def test_the_forced_call_grammar_accepts_only_valid_calls():
    tokenizer = byte_tokenizer()
    lltok = llguidance.hf.from_tokenizer(tokenizer)
    tools = [ToolDef.model_validate(WEATHER), ToolDef.model_validate(TIME)]

    def accepts(grammar: str, text: str) -> bool:
        matcher = llguidance.LLMatcher(lltok, llguidance.grammar_from("lark", grammar))
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()

    several = forced_call_grammar(tools, tool_call_format("hermes"), several=True)
    one = forced_call_grammar(tools[:1], tool_call_format("hermes"), several=False)
    assert accepts(several, CALL) and accepts(one, CALL)
    assert accepts(several, CALL + "\n" + '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')
    assert not accepts(one, CALL + "\n" + CALL)  # a named function: exactly one call
    assert not accepts(several, CALL.replace("get_weather", "get_wether"))
    assert not accepts(several, CALL.replace('{"city": "Paris"}', '{"town": 3}'))
    assert not accepts(several, "Sure! " + CALL)


def test_a_forced_call_takes_tags_the_vocabulary_holds_as_added_tokens():
    """Qwen2.5 adds `<tool_call>` and `</tool_call>` as tokens (not special) and writes them so: the grammar's mask
    allowed the token but the matcher refused it when committed, so every forced call failed at its first token.
    Each tag is now that token or its text, and both are followed to the end of the call."""
    import numpy as np
    import llguidance.numpy

    from services.gateway.tokenizer import added_token_id

    tokenizer = byte_tokenizer()
    tokenizer.add_tokens(["<tool_call>", "</tool_call>"])  # as Qwen2.5's vocabulary holds them
    open_id, close_id = (tokenizer.convert_tokens_to_ids(tag) for tag in ("<tool_call>", "</tool_call>"))
    lltok = llguidance.hf.from_tokenizer(tokenizer)
    grammar = forced_call_grammar([ToolDef.model_validate(WEATHER)], tool_call_format("hermes"), several=False,
                                  added_token_id=partial(added_token_id, tokenizer))
    body = tokenizer('\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n', add_special_tokens=False)
    for ids in ([open_id, *body["input_ids"], close_id], tokenizer(CALL, add_special_tokens=False)["input_ids"]):
        matcher = llguidance.LLMatcher(lltok, llguidance.grammar_from("lark", grammar))
        mask = np.zeros((1, (lltok.vocab_size + 31) // 32), dtype=np.int32)
        llguidance.numpy.fill_next_token_bitmask_par(llguidance.LLExecutor(), [(matcher, 0)], mask)
        assert (mask[0, open_id // 32] >> (open_id % 32)) & 1  # the mask allows the added token ...
        # ... and so does the matcher when it is committed
        assert matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting(), matcher.get_error()


@pytest.fixture
def tool_verifier(verifier):
    verifier.reply = "Checking." + CALL
    verifier.tokens_per_step = 4
    verifier.max_model_len = 4096  # a byte per token: the tools' listing is long
    return verifier


def test_sdk_gets_tool_calls_whole_and_streamed(served, tool_verifier):
    client = openai.OpenAI(base_url=served() + "/v1", api_key="unused", max_retries=0)
    reply = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER, TIME])
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}

    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for part in delta.tool_calls or []:
            entry = calls.setdefault(part.index, {"id": part.id, "name": "", "arguments": ""})
            entry["name"] += part.function.name or ""
            entry["arguments"] += part.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert content == "Checking." and finish == "tool_calls"
    assert calls[0]["name"] == "get_weather" and json.loads(calls[0]["arguments"]) == {"city": "Paris"}
    assert calls[0]["id"].startswith("call_")


async def test_tool_choice_none_auto_required_and_named(client, tool_verifier, tokenizer):
    async def chat(**fields):
        tool_verifier.requests.clear()
        r = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, **fields})
        assert r.status_code == 200, r.text
        request = tool_verifier.requests[0]
        return r.json()["choices"][0], tokenizer.decode(list(request.prompt_token_ids)), request

    none, prompt, request = await chat(tools=[WEATHER], tool_choice="none")
    assert "get_weather" not in prompt and none["message"]["content"] == "Checking." + CALL  # not offered, not read
    auto, prompt, request = await chat(tools=[WEATHER, TIME])
    assert "get_weather" in prompt and "get_time" in prompt and auto["message"]["tool_calls"]
    assert not request.sampling.HasField("structured_output")  # auto: the model decides
    _, _, request = await chat(tools=[WEATHER, TIME], tool_choice="required")
    grammar = request.sampling.structured_output.grammar
    assert "get_weather" in grammar and "get_time" in grammar and '("\\n" call)*' in grammar
    _, prompt, request = await chat(tools=[WEATHER, TIME], tool_choice={"type": "function",
                                                                        "function": {"name": "get_time"}})
    grammar = request.sampling.structured_output.grammar
    assert "get_time" in grammar and "get_weather" not in grammar and "call)*" not in grammar
    assert "get_weather" not in prompt  # only the forced tool is offered
    _, _, request = await chat(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    assert "call)*" not in request.sampling.structured_output.grammar
    r = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": ASK, "tools": [WEATHER],
                                                        "tool_choice": "required",
                                                        "response_format": {"type": "json_object"}})
    assert r.status_code == 400 and "tool_choice" in r.json()["error"]["message"]


SECOND_TURN = ASK + [
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
]


async def test_second_turn_renders_calls_and_results_without_tool_support_in_the_template(client, verifier,
                                                                                        tokenizer):
    verifier.reply = "It is sunny."
    verifier.max_model_len = 4096
    r = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": SECOND_TURN, "tools": [WEATHER]})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"] == {"role": "assistant", "content": "It is sunny."}
    prompt = tokenizer.decode(list(verifier.requests[0].prompt_token_ids))
    assert prompt.startswith("<|system|># Tools") and '"name": "get_weather"' in prompt  # the listing
    assert '<|assistant|><tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert "<|user|><tool_response>\nsunny, 21 C\n</tool_response>" in prompt


TOOLS_TEMPLATE = ("{% if tools %}<|tools|>{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
                  "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}"
                  "{% for c in m.tool_calls or [] %}[call {{ c.function.name }} {{ c.function.arguments.city }}]"
                  "{% endfor %}{% if m.tool_call_id %}[for {{ m.tool_call_id }}]{% endif %}\n{% endfor %}"
                  "{% if add_generation_prompt %}<|assistant|>{% endif %}")


async def test_a_template_that_knows_tools_gets_them_as_transformers_passes_them(scripted, verifier):
    verifier.max_model_len = 4096
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = TOOLS_TEMPLATE
    app = create_app(GatewaySettings(verifier=scripted[1]), tokenizer=tokenizer)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw") as http:
        r = await http.post("/v1/chat/completions", json={"model": MODEL, "messages": SECOND_TURN,
                                                          "tools": [WEATHER, TIME]})
    await app.state.gateway.client.close()
    assert r.status_code == 200, r.text
    prompt = tokenizer.decode(list(verifier.requests[0].prompt_token_ids))
    assert prompt == ("<|tools|>get_weather;get_time;<|user|>Weather in Paris?"  # trim_blocks eats the newlines
                      "<|assistant|>[call get_weather Paris]<|tool|>sunny, 21 C[for call_1]<|assistant|>")


def test_an_unknown_tool_call_parser_fails_at_start_up(scripted):
    with pytest.raises(ValueError, match="unknown tool call parser"):
        create_app(GatewaySettings(verifier=scripted[1], tool_call_parser="nope"), tokenizer=byte_tokenizer())
