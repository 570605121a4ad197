"""One response builder per kind of generation request: the whole response, and a stream's chunks, of
/v1/completions (CompletionResponses) and /v1/chat/completions (ChatResponses), from the choices' events.

The request pipeline (pipeline.py) is the same for both; only the shapes differ, and they differ here alone, so a
field that appears in responses lands in one place per kind. A builder lives for one request: it keeps what a
stream has sent so far (echoes, offsets, tool calls, the prompt's ids).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from pydantic import BaseModel

from services.gateway import schemas as s
from services.gateway.errors import ApiError
from services.gateway.generation import ChoiceEvent
from services.gateway.responses import Accounting, LogprobFormatter, PromptReturn, joined
from services.gateway.tools.output import StreamedChoice, ToolOutput


@dataclass
class ChoiceOutput:
    """A finished choice, collected from its events (non-streamed responses)."""

    text: str
    logprobs: list[Any] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)


@dataclass
class RequestContext:
    """What both kinds of response need to know about the request and its choices. choice_echo / choice_prompt:
    per choice index, the text it starts with (a completion's echo, "" otherwise) and its prompt's ids;
    prompt_logprobs: the verifier's prompt scores per choice (filled from each choice's first message)."""

    rid: str
    created: int
    served: str
    req: s.SamplingFields
    formatter: LogprobFormatter
    returned: PromptReturn
    logprobs: int | None  # alternatives asked per generated token (None: no logprobs)
    accounting: Accounting
    choice_echo: dict[int, str]
    choice_prompt: dict[int, list[int]]
    prompt_logprobs: dict[int, list[Any]]

    @property
    def ids_back(self) -> bool:
        """vLLM's return_token_ids: the prompt's and the output's ids in the response."""
        return self.req.return_token_ids

    def scored_prompt(self, index: int) -> s.PromptLogprobs | None:
        """vLLM's prompt_logprobs of one choice's prompt, when asked."""
        if self.returned.prompt_logprobs is None:
            return None
        return self.formatter.prompt_logprobs(self.prompt_logprobs[index], self.returned.prompt_logprobs)


class ResponseBuilder(Protocol):
    """What the pipeline asks of a builder: the whole response, or a stream's messages (those that open it, those
    for each event, those that close it, the usage message when asked) and whether `data: [DONE]` ends it."""

    ctx: RequestContext
    ends_with_done: bool

    def whole(self, outputs: dict[int, ChoiceOutput]) -> BaseModel: ...

    def opening_chunks(self) -> list[BaseModel]: ...

    def chunk(self, event: ChoiceEvent, speculation: s.SpeculativeDecoding | None) -> BaseModel | list[BaseModel]: ...

    def closing_chunks(self) -> list[BaseModel]: ...

    def usage_chunk(self) -> BaseModel | None: ...

    def error_chunks(self, error: ApiError) -> list[BaseModel | dict]: ...


class ErrorBodyChunk:
    """Chat and completion streams say a failure after they began with the error's body (`{"error": {...}}`), as
    OpenAI's and vLLM's servers do; the OpenAI SDK raises it as an APIError."""

    def error_chunks(self, error: ApiError) -> list[dict]:
        return [error.body()]


class CompletionResponses(ErrorBodyChunk):
    """/v1/completions: text choices, with the echoed prompt (and its logprobs) in front when asked."""

    ends_with_done = True  # a stream's last line is `data: [DONE]`

    def __init__(self, ctx: RequestContext) -> None:
        self.ctx = ctx
        self._offsets = {i: len(echo) for i, echo in ctx.choice_echo.items()}  # text_offset of the next token
        self._unechoed = set(ctx.choice_echo) if ctx.returned.echo else set()
        self._prompt_ids_unsent = set(ctx.choice_echo) if ctx.ids_back else set()

    def _logprobs(self, index: int, generated: list[Any], offset: int, with_prompt: bool) -> s.CompletionLogprobs:
        ctx = self.ctx
        out = ctx.formatter.completion(generated, offset)
        if with_prompt and ctx.returned.echo_logprobs is not None:
            prompt = ctx.formatter.echoed_prompt(ctx.choice_prompt[index], ctx.prompt_logprobs[index],
                                                 ctx.returned.echo_logprobs)
            out = joined(prompt, out)
        return out

    def whole(self, outputs: dict[int, ChoiceOutput]) -> BaseModel:
        ctx = self.ctx
        finished = ctx.accounting.finished
        return s.CompletionResponse(
            id=ctx.rid, created=ctx.created, model=ctx.served, usage=ctx.accounting.usage(),
            speculative_decoding=ctx.accounting.speculation().model(),
            choices=[s.CompletionChoice(
                index=i, text=ctx.choice_echo[i] + out.text,
                finish_reason=finished[i].finish_reason if i in finished else None,
                stop_reason=finished[i].stop_reason if i in finished else None,
                logprobs=self._logprobs(i, out.logprobs, len(ctx.choice_echo[i]), True)
                if ctx.logprobs is not None else None,
                prompt_logprobs=ctx.scored_prompt(i),
                prompt_token_ids=ctx.choice_prompt[i] if ctx.ids_back else None,
                token_ids=out.token_ids if ctx.ids_back else None,
            ) for i, out in sorted(outputs.items())])

    def opening_chunks(self) -> list[BaseModel]:
        return []

    def chunk(self, event: ChoiceEvent, speculation: s.SpeculativeDecoding | None) -> BaseModel:
        """The echo (and with logprobs its tokens) leads a choice's first chunk, which waits for the verifier's
        first message (it carries the prompt logprobs), as in vLLM; so do the prompt's ids when asked."""
        ctx, index = self.ctx, event.index
        echoing = index in self._unechoed
        self._unechoed.discard(index)
        chunk = s.CompletionChunk(
            id=ctx.rid, created=ctx.created, model=ctx.served, speculative_decoding=speculation, choices=[
                s.CompletionChoice(
                    index=index, text=(ctx.choice_echo[index] if echoing else "") + event.text,
                    finish_reason=event.finish_reason, stop_reason=event.stop_reason,
                    logprobs=self._logprobs(index, event.logprobs, self._offsets[index], echoing)
                    if ctx.logprobs is not None else None,
                    prompt_token_ids=ctx.choice_prompt[index] if index in self._prompt_ids_unsent else None,
                    token_ids=event.token_ids if ctx.ids_back else None)])
        self._prompt_ids_unsent.discard(index)
        self._offsets[index] += len(event.text)
        return chunk

    def closing_chunks(self) -> list[BaseModel]:
        return []

    def usage_chunk(self) -> BaseModel:
        ctx = self.ctx
        return s.CompletionChunk(id=ctx.rid, created=ctx.created, model=ctx.served, choices=[],
                                 usage=ctx.accounting.usage(),
                                 speculative_decoding=ctx.accounting.speculation().model())


class ChatResponses(ErrorBodyChunk):
    """/v1/chat/completions: assistant messages, with tool calls read out of the text when the request offers
    tools (`tools`; None: not at all)."""

    ends_with_done = True

    def __init__(self, ctx: RequestContext, tools: ToolOutput | None = None) -> None:
        self.ctx = ctx
        self.tools = tools
        self._calls = {i: StreamedChoice(tools) for i in ctx.choice_echo} if tools is not None else {}

    def _logprobs(self, generated: list[Any]) -> s.ChatLogprobs | None:
        return self.ctx.formatter.chat(generated) if self.ctx.logprobs is not None else None

    def whole(self, outputs: dict[int, ChoiceOutput]) -> BaseModel:
        ctx = self.ctx
        finished = ctx.accounting.finished
        choices = []
        for i, out in sorted(outputs.items()):
            reason = finished[i].finish_reason if i in finished else None
            content, calls, reason = (self.tools.message(out.text, reason) if self.tools is not None
                                      else (out.text, None, reason))
            choices.append(s.ChatChoice(index=i, message=s.AssistantMessage(content=content, tool_calls=calls),
                                        logprobs=self._logprobs(out.logprobs), finish_reason=reason,
                                        stop_reason=finished[i].stop_reason if i in finished else None,
                                        token_ids=out.token_ids if ctx.ids_back else None))
        return s.ChatCompletionResponse(
            id=ctx.rid, created=ctx.created, model=ctx.served, usage=ctx.accounting.usage(),
            speculative_decoding=ctx.accounting.speculation().model(), choices=choices,
            prompt_logprobs=ctx.scored_prompt(0), prompt_token_ids=ctx.choice_prompt[0] if ctx.ids_back else None)

    def opening_chunks(self) -> list[BaseModel]:
        """The first chunk of each choice carries the role (and the prompt's ids, when asked)."""
        ctx = self.ctx
        return [s.ChatCompletionChunk(id=ctx.rid, created=ctx.created, model=ctx.served, choices=[
            s.ChatChunkChoice(index=i, delta=s.ChatDelta(role="assistant", content=""))],
            usage=ctx.accounting.usage_so_far() if ctx.req.continuous_usage else None,
            prompt_token_ids=ctx.choice_prompt[i] if ctx.ids_back else None) for i in sorted(ctx.choice_echo)]

    def chunk(self, event: ChoiceEvent, speculation: s.SpeculativeDecoding | None) -> BaseModel:
        """Tool calls are taken out of the text as they complete."""
        ctx = self.ctx
        content, tool_calls, reason = event.text or None, None, event.finish_reason
        if event.index in self._calls:
            choice = self._calls[event.index]
            content, tool_calls = choice.feed(event.text, event.finish_reason is not None)
            reason = choice.finish_reason(event.finish_reason)
        return s.ChatCompletionChunk(
            id=ctx.rid, created=ctx.created, model=ctx.served, speculative_decoding=speculation, choices=[
                s.ChatChunkChoice(index=event.index, finish_reason=reason, stop_reason=event.stop_reason,
                                  delta=s.ChatDelta(content=content, tool_calls=tool_calls),
                                  logprobs=self._logprobs(event.logprobs),
                                  token_ids=event.token_ids if ctx.ids_back else None)])

    def closing_chunks(self) -> list[BaseModel]:
        return []

    def usage_chunk(self) -> BaseModel:
        ctx = self.ctx
        return s.ChatCompletionChunk(id=ctx.rid, created=ctx.created, model=ctx.served, choices=[],
                                     usage=ctx.accounting.usage(),
                                     speculative_decoding=ctx.accounting.speculation().model())
