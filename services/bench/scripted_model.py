"""A model that costs next to nothing and says what a script says: what the engine-host-cost bench drives the
engine with, so that the time measured is the engine's own (or, with a simulated device, the engine's own plus a
step time of the shape an accelerator's captured step has).

Four scripts: `repeating` (a period of 40 tokens: n-gram drafts from the context are right), `novel` (no token
repeats within the vocabulary: n-gram drafting never has a draft) and `chat`, the case between them that serving
new chat text is: phrases that recur with words changed, so that an n-gram drafter mostly has a draft from some
earlier occurrence and a token or two of it is accepted (about half the rows drafting, 0.6 tokens accepted a
draft of 4 on the H200's chats, stop 53). Each chat request has text of its own (its prompt's first token, its
salt, chooses where which phrase goes and which words change), as different chats do: a suffix drafter, which
drafts from every request it has seen, would otherwise find each request's whole answer in the ones before.
`mixed` is a server's mixed traffic: one request in MIXED_REPEATING_EVERY (by salt) repeats, as a code edit does,
the others chat, so that a batch holds rows whose drafts are worth asking for beside rows whose drafts are not."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import torch

from services.modeling.block_pool import PrefixCacheStats
from services.modeling.runner import ForwardOutput, KVUsage, RowInput

SCRIPT_PERIOD = 40
CONFIDENT = 30.0  # the scripted token's logit; every other token's is 0
SCRIPTS = ("repeating", "novel", "chat", "mixed")
CHAT_PHRASE = 6  # tokens a phrase
CHAT_PHRASES = 12  # distinct phrases the chat script draws from
CHAT_CHANGED_PERCENT = 30  # of a chat phrase's tokens, the share replaced by a token of nowhere in particular
MIXED_REPEATING_EVERY = 8  # in mixed traffic, the requests whose salt is a multiple of this repeat; the others chat


def mix(value: int) -> int:
    """An integer hash (Knuth's multiplicative, then a fold): scripted, not random, so runs repeat exactly."""
    value = (value * 2654435761) & 0xFFFFFFFF
    return value ^ (value >> 15)


@dataclass(frozen=True)
class Script:
    kind: str
    vocab: int

    def __post_init__(self) -> None:
        if self.kind not in SCRIPTS:
            raise ValueError(f"script must be one of {SCRIPTS}, got {self.kind!r}")

    def token(self, position: int, salt: int = 0) -> int:
        """The token the scripted model puts at `position` of a request with this salt (chat and mixed text only;
        the salt is the request's first token)."""
        if self.kind == "repeating":
            return script_token(position, self.vocab)
        if self.kind == "novel":
            return script_token(position, self.vocab, period=self.vocab)
        if position == 0:
            return salt % self.vocab
        if self.kind == "mixed" and salt % MIXED_REPEATING_EVERY == 0:
            return script_token(position, self.vocab)
        mixed = position + salt * 1_000_003
        if mix(mixed * 3 + 1) % 100 < CHAT_CHANGED_PERCENT:
            return mix(mixed * 5 + 2) % self.vocab
        phrase = mix(mixed // CHAT_PHRASE) % CHAT_PHRASES
        return mix(phrase * CHAT_PHRASE + position % CHAT_PHRASE + 7) % self.vocab

    def salt_of(self, prompt: Sequence[int]) -> int:
        """The salt of a request whose prompt (or its first prefill chunk) is `prompt`."""
        return prompt[0] if self.kind in ("chat", "mixed") and prompt else 0

    def prompt(self, offset: int) -> tuple[int, ...]:
        """The benches' request number `offset`: the script's first 2 periods and `offset` tokens more (requests
        of different lengths, so their steps are not all alike); chat text salted by `offset`."""
        salt = offset % self.vocab
        return tuple(self.token(p, salt) for p in range(2 * SCRIPT_PERIOD + offset))

    def repeats(self, offset: int) -> bool:
        """Whether the benches' request number `offset` repeats (mixed text's code-edit-like requests)."""
        return self.kind == "repeating" or (self.kind == "mixed" and offset % self.vocab % MIXED_REPEATING_EVERY == 0)

    def continues(self, prompt: Sequence[int], output: Sequence[int]) -> bool:
        """Whether `output` is what the script says after `prompt` (a prompt of the script's own)."""
        salt = self.salt_of(prompt)
        return list(output) == [self.token(len(prompt) + j, salt) for j in range(len(output))]


def script_token(position: int, vocab: int, period: int = SCRIPT_PERIOD) -> int:
    """The token at `position` of a period of `period` distinct tokens (at most `vocab`)."""
    return (position % period * 7919 + 13) % vocab


@dataclass(frozen=True)
class SimulatedDevice:
    """A step time of an accelerator's shape, slept inside the forward, as a host waits on its device:
    `base_ms` + `row_ms` a row beyond the first + `token_ms` a token beyond one a row, and for a step that verifies
    drafts (more tokens than rows) `verify_ms` + `verify_row_ms` a row more. The default is the H200's captured
    SmolLM2-135M step in bf16 (stop 53: 2.4 ms at 1 row, 2.8 at 8, 4.7 at 64 on the device; 0.5 ms more at 64 rows
    verifying 4 drafts each), without the verify terms. With them (`--simulated-verify-ms 0.3 0.02`): a verify's
    first draft column pays in attention over every position read (replayed step graphs on an H100: 1 x 2 tokens
    20% over 1 x 1, 64 x 2 22% over 64 x 1, at 512 positions), and on the H200 in stop 74 the steps that verified
    ngram drafts at 64 chats took 1.6 ms more on the device than plain ones (5.1 ms): 0.3 ms + 0.02 a row gives 1.6
    at 64 rows and 0.3 at one."""

    base_ms: float = 2.4
    row_ms: float = 0.035
    token_ms: float = 0.002
    verify_ms: float = 0.0
    verify_row_ms: float = 0.0

    def seconds(self, rows: int, tokens: int) -> float:
        verify = self.verify_ms + self.verify_row_ms * rows if tokens > rows else 0.0
        return (self.base_ms + self.row_ms * (rows - 1) + self.token_ms * (tokens - rows) + verify) / 1000.0


class ScriptedRunner:
    """A ModelRunner whose forward costs next to nothing (or a simulated device's time): at every position it
    predicts the script's next token."""

    supports_trees = False
    device = torch.device("cpu")
    caches_hidden_states = False  # until keep_hidden_states

    def __init__(self, max_num_seqs: int, script: Script, max_model_len: int = 8192,
                 simulated: SimulatedDevice | None = None, state_width: int = 1) -> None:
        """state_width: the width of the hidden states a forward returns (what a drafter reading them, as EAGLE
        does, is declared to read); their values are not meaningful."""
        self.vocab_size = script.vocab
        self._state_width = state_width
        self.script = script
        self.simulated = simulated
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.forwards = 0
        self.captured_forwards = 0  # of them, those verified in the simulated graph (forward_with_tail)
        self.forward_s = 0.0
        self._lengths: dict[Hashable, int] = {}
        self._salts: dict[Hashable, int] = {}  # each sequence's (Script.salt_of), read from its first prefill row

    def add_sequence(self, seq_id: Hashable, prompt: Sequence[int] = ()) -> int:
        self._lengths[seq_id] = 0
        return 0

    def remove_sequence(self, seq_id: Hashable) -> None:
        self._lengths.pop(seq_id, None)
        self._salts.pop(seq_id, None)

    def num_free_slots(self) -> int:
        return self.max_num_seqs - len(self._lengths)

    def length(self, seq_id: Hashable) -> int:
        return self._lengths[seq_id]

    def truncate(self, seq_id: Hashable, length: int) -> None:
        self._lengths[seq_id] = length

    def kv_blocks_needed(self, seq_id: Hashable | None, length: int) -> int:
        return 0

    def kv_blocks_available(self) -> int:
        return 1 << 30

    def reserve(self, seq_id: Hashable, length: int) -> None:
        pass

    def capture_graphs(self, max_width: int, tails: Sequence = ()) -> int:
        return 0

    def keep_hidden_states(self) -> None:
        """As llama_runner: the runner keeps every position's states (a device's step writes them beside the K/V
        within its graph; here nothing is written, their values meaning nothing), so requests leave theirs here
        (runner_kept_states.py) instead of taking them from each step."""
        self.caches_hidden_states = True

    def kept_hidden_states_of(self, ranges: Sequence[tuple[Hashable, int, int]]) -> torch.Tensor:
        """The ranges' states on the host: written once, as a device's copy to the host writes them."""
        return torch.zeros(sum(stop - start for _, start, stop in ranges), self._state_width)

    @property
    def kv_usage(self) -> KVUsage:
        return KVUsage(1, 0, 0, 16, PrefixCacheStats())

    def forward(self, rows: Sequence[RowInput]) -> ForwardOutput:
        started = time.perf_counter()
        width = max(len(row.token_ids) for row in rows)
        logits, states = self._scripted(rows, width)
        self._wait_for_device(len(rows), width, started)
        return ForwardOutput(logits=logits, hidden_states=states)

    def forward_with_tail(self, rows: Sequence[RowInput], tail, launched: Callable[[], None] = lambda: None
                          ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """As an accelerator's captured step (llama_runner.forward_with_tail): the tail (captured_verify.VerifyTail)
        runs on the forward's logits within the simulated device time, so that the engine's host does for a plain
        decode step what it does on a GPU (packs the tail's inputs, reads one result) and not the eager
        verification a CPU step runs. The device time starts once the tail's inputs are packed; `launched` is
        called once the logits and the tail are computed (on this host's cores, within the device time), so that
        the engine's loop serves what the last step woke during the rest of it: called as the time starts, the
        loop's work and the tail's tensor math (its intra-op threads) shared two cores, and a 1-row step that
        verified 4 drafts took 7 ms where 2.4 were simulated. Only with a simulated device: without one (None) the
        engine runs forward()."""
        if self.simulated is None or any(row.parents is not None for row in rows):
            return None
        width = max(len(row.token_ids) for row in rows)
        inputs = tail.inputs(len(rows), width)  # host work, before the replay
        started = time.perf_counter()
        logits, states = self._scripted(rows, width)
        out = tail.run(logits, inputs)
        launched()
        self.captured_forwards += 1
        self._wait_for_device(len(rows), width, started)
        return out, states

    def _scripted(self, rows: Sequence[RowInput], width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows' logits [B, max num_logits, V] and hidden states [B, width (the widest row's), state width]."""
        self.forwards += 1
        logits = torch.zeros(len(rows), max(row.num_logits for row in rows), self.vocab_size)
        for b, row in enumerate(rows):
            start, fed = self._lengths[row.seq_id], len(row.token_ids)
            if start == 0:
                self._salts[row.seq_id] = self.script.salt_of(row.token_ids)
            salt = self._salts[row.seq_id]
            for i in range(row.num_logits):  # logits i belong to fed position fed - num_logits + i
                position = start + fed - row.num_logits + i + 1
                logits[b, i, self.script.token(position, salt)] = CONFIDENT
            self._lengths[row.seq_id] = start + fed
        return logits, torch.empty(len(rows), width, self._state_width)  # a tensor of its own, as a forward's are

    def _wait_for_device(self, rows: int, width: int, started: float) -> None:
        """Sleep what is left of the simulated step of `rows` rows of `width` tokens begun at `started` (padded to the
        widest, as the engine's decode rows are), and count the forward's time."""
        if self.simulated is not None:
            time.sleep(max(0.0, self.simulated.seconds(rows, rows * width) - (time.perf_counter() - started)))
        self.forward_s += time.perf_counter() - started


def add_simulated_step_argument(parser) -> None:
    """--simulated-step-ms BASE ROW TOKEN, defaulting to the H200's captured SmolLM2 step (SimulatedDevice())."""
    default = SimulatedDevice()
    parser.add_argument("--simulated-step-ms", type=float, nargs=3, metavar=("BASE", "ROW", "TOKEN"),
                        default=[default.base_ms, default.row_ms, default.token_ms],
                        help="the device step slept in each forward: BASE ms + ROW ms a row beyond the first + TOKEN "
                             "ms a token beyond one a row (default: the H200's captured SmolLM2 step)")
    add_simulated_verify_argument(parser)


def add_simulated_verify_argument(parser) -> None:
    parser.add_argument("--simulated-verify-ms", type=float, nargs=2, metavar=("BASE", "ROW"), default=[0.0, 0.0],
                        help="what a simulated step that verifies drafts costs more: BASE ms + ROW ms a row (0.3 0.02: "
                             "the H200's, stop 74; default none)")


def simulated_device(args) -> SimulatedDevice:
    """The SimulatedDevice of --simulated-step-ms and --simulated-verify-ms."""
    return SimulatedDevice(*args.simulated_step_ms, *args.simulated_verify_ms)


def add_client_load_arguments(parser, rows: list[int], tokens: int) -> None:
    """What a bench that serves the scripted engine to a client process of its own takes (verifier_stream_cost,
    http_host_cost): --rows, --tokens, --vocab, --text (chat), --rounds, --simulated-step-ms, and the hidden --client
    PORT with which the bench starts that process."""
    parser.add_argument("--rows", type=int, nargs="+", default=rows)
    parser.add_argument("--tokens", type=int, default=tokens)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--text", choices=SCRIPTS, default="chat")
    parser.add_argument("--rounds", type=int, default=2, help="measured rounds of `rows` requests at once")
    add_simulated_step_argument(parser)
    parser.add_argument("--client", type=int, metavar="PORT", help=argparse.SUPPRESS)  # the client process
