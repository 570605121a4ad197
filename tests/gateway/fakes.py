"""Test parts for the gateway: a real byte-level tokenizer built in-process, and a scripted Verifier served over
real gRPC (a sync grpc.server in its own threads, so it serves any event loop or thread the tests use).

The tokenizer maps each byte to the token id equal to its value (no merges), plus <|endoftext|> = 256, so
scripted outputs are just UTF-8 bytes, and multi-byte characters really are split across tokens.
"""

from __future__ import annotations

import threading
from concurrent import futures
from dataclasses import dataclass, field

import grpc
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from services.common import protos

pb, pb_grpc = protos.load("verifier")

EOS = 256
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-ins for bytes, which the ByteLevel pre-tokenizer/decoder use."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def byte_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>"])
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", chat_template=CHAT_TEMPLATE)


def ids_of(text: str) -> list[int]:
    return list(text.encode("utf-8"))


@dataclass
class ScriptedVerifier(pb_grpc.VerifierServicer):
    """Answers every Generate with the UTF-8 bytes of `reply` (then EOS), `tokens_per_step` per message, and
    plausible speculation stats; records requests and which calls were cancelled by the client. Like the engine,
    it ends on the first stop_token_ids (or EOS) token from min_tokens on, and names it in stop_token_id.

    Failure scripts: the next `unavailable_calls` Generate calls fail with UNAVAILABLE before any message (a
    connection lost before the answer); `unavailable_after_first` fails every call after its first message;
    `logprob` is the value sent for every logprob (e.g. -inf, as a token filtered by top-p has)."""

    reply: str = "Hello, wörld! 你好. The end."
    tokens_per_step: int = 3
    step_delay_s: float = 0.0
    first_delay_s: float = 0.0  # before the first message (a long prefill or queue wait)
    max_model_len: int = 256
    overloaded: bool = False
    unavailable_calls: int = 0
    unavailable_after_first: bool = False
    logprob: float = -0.5
    max_logprobs: int = 20
    drafters: list = field(default_factory=list)
    tokenizer_fingerprint: str = ""
    model_id: str = "tiny-test"
    requests: list = field(default_factory=list)
    cancelled: list = field(default_factory=list)
    completed: list = field(default_factory=list)

    def reset(self) -> None:
        self.__init__()  # type: ignore[misc]

    def Info(self, request, context):
        return pb.InfoResponse(model_id=self.model_id, max_model_len=self.max_model_len, vocab_size=257,
                               eos_token_ids=[EOS], drafters=self.drafters, max_num_seqs=4,
                               default_speculative_method="ngram", default_num_speculative_tokens=3,
                               tokenizer_fingerprint=self.tokenizer_fingerprint, max_logprobs=self.max_logprobs)

    def Generate(self, request, context):
        self.requests.append(request)
        if self.overloaded:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          "the waiting queue is full: 3 requests already waiting for 4 busy slots (max_waiting_requests=3)")
        if self.unavailable_calls > 0:
            self.unavailable_calls -= 1
            context.abort(grpc.StatusCode.UNAVAILABLE, "Socket closed")
        prompt_len = len(request.prompt_token_ids)
        if prompt_len >= self.max_model_len:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"prompt has {prompt_len} tokens; max_model_len is {self.max_model_len}")
        done = threading.Event()
        context.add_callback(lambda: None if done.is_set() else self.cancelled.append(request.request_id))
        sp = request.sampling
        script = ids_of(self.reply)
        if sp.ignore_eos:
            script = script * (1 + sp.max_tokens // max(1, len(script)))
        else:
            script = script + [EOS]
        stops = set(sp.stop_token_ids) | (set() if sp.ignore_eos else {EOS})
        ending = next((i for i, t in enumerate(script) if t in stops and i >= sp.min_tokens), None)
        if ending is not None:
            script = script[: ending + 1]
        out = script[:sp.max_tokens]
        finish = pb.FINISH_REASON_STOP if ending is not None and len(out) == ending + 1 else pb.FINISH_REASON_LENGTH
        stop_token = out[-1] if finish == pb.FINISH_REASON_STOP else None
        speculate = request.speculation.method != "none"
        stats = pb.SpeculationStats(method=(request.speculation.method or "ngram") if speculate else "")
        if self.first_delay_s:
            threading.Event().wait(self.first_delay_s)
        prompt_logprobs = []
        if sp.HasField("prompt_logprobs"):  # every prompt token after the first, its top alternative itself
            prompt_logprobs = [pb.TokenLogprob(token_id=t, logprob=self.logprob, rank=1,
                                               top=[pb.TopLogprob(token_id=t, logprob=self.logprob)][:sp.prompt_logprobs])
                               for t in request.prompt_token_ids[1:]]
        if not out:  # max_tokens 0: one message, after the prefill
            yield pb.GenerateResponse(finish_reason=pb.FINISH_REASON_LENGTH, prompt_logprobs=prompt_logprobs,
                                      usage=pb.Usage(prompt_tokens=prompt_len), speculation=stats)
        for start in range(0, len(out), self.tokens_per_step):
            if self.step_delay_s:
                threading.Event().wait(self.step_delay_s)
            if not context.is_active():
                return
            if self.unavailable_after_first and start > 0:
                context.abort(grpc.StatusCode.UNAVAILABLE, "Socket closed")
            chunk = out[start:start + self.tokens_per_step]
            if speculate and start > 0:
                stats.num_drafts += 1
                stats.num_draft_tokens += 3
                stats.num_accepted_tokens += len(chunk) - 1
            last = start + self.tokens_per_step >= len(out)
            logprobs = []
            if sp.HasField("logprobs"):
                logprobs = [pb.TokenLogprob(token_id=t, logprob=self.logprob,
                                            top=[pb.TopLogprob(token_id=t, logprob=self.logprob)][:sp.logprobs])
                            for t in chunk]
            yield pb.GenerateResponse(
                token_ids=chunk, logprobs=logprobs,
                finish_reason=finish if last else pb.FINISH_REASON_UNSPECIFIED,
                usage=pb.Usage(prompt_tokens=prompt_len, completion_tokens=min(len(out), start + len(chunk))),
                speculation=stats, prompt_logprobs=prompt_logprobs if start == 0 else [],
                stop_token_id=stop_token if last else None)
        done.set()
        self.completed.append(request.request_id)


def start_scripted_verifier() -> tuple[ScriptedVerifier, grpc.Server, str]:
    servicer = ScriptedVerifier()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16))
    pb_grpc.add_VerifierServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return servicer, server, f"127.0.0.1:{port}"
