"""Turning a stream of token ids into a stream of text, safely.

Byte-level tokenizers split multi-byte characters across tokens: decoding a token alone yields U+FFFD. So the
detokenizer decodes a small sliding window of ids (vLLM's prefix/read offsets, which also keeps leading-space
handling of sentencepiece tokenizers right) and holds text back while it ends with U+FFFD. Stop strings can
span chunks: the matcher holds back the longest tail that could still become a stop string.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"
_CONTEXT_TOKENS = 5  # prompt tokens decoded in front of the output so the first token's spacing is right


class IncrementalDetokenizer:
    """Feed ids with `push`, get only the new text; `flush` at the end releases anything held back."""

    def __init__(self, decode: Callable[[list[int]], str], prompt_ids: Sequence[int] = ()) -> None:
        self._decode = decode
        self._ids: list[int] = list(prompt_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def push(self, token_ids: Sequence[int]) -> str:
        self._ids.extend(token_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self._read_offset >= len(self._ids):
            return ""
        prefix = self._decode(self._ids[self._prefix_offset:self._read_offset])
        text = self._decode(self._ids[self._prefix_offset:])
        if len(text) <= len(prefix) or (text.endswith(REPLACEMENT) and not final):
            return ""  # an incomplete character (or nothing visible yet): wait for more ids
        new = text[len(prefix):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return new


class StopStringMatcher:
    """Finds stop strings in streamed text. `push` returns (text safe to emit, stopped); everything after the
    stop string is never emitted, nor the stop string itself unless `include_stop` (vLLM's
    include_stop_str_in_output). `matched` is the stop string found."""

    def __init__(self, stops: Sequence[str], include_stop: bool = False) -> None:
        self._stops = [s for s in stops if s]
        self._include_stop = include_stop
        self._buffer = ""
        self.stopped = False
        self.matched: str | None = None

    def push(self, text: str, check: bool = True) -> tuple[str, bool]:
        """check False: the text is passed on unsearched (vLLM's min_tokens: no stop string before then)."""
        if self.stopped:
            return "", True
        if not self._stops:
            return text, False
        self._buffer += text
        if not check:
            out, self._buffer = self._buffer, ""
            return out, False
        hits = [(i, stop) for i, stop in ((self._buffer.find(stop), stop) for stop in self._stops) if i >= 0]
        if hits:
            at, self.matched = min(hits, key=lambda hit: hit[0])
            end = at + len(self.matched) if self._include_stop else at
            out, self._buffer, self.stopped = self._buffer[:end], "", True
            return out, True
        hold = self._held_tail_length()
        cut = len(self._buffer) - hold
        out, self._buffer = self._buffer[:cut], self._buffer[cut:]
        return out, False

    def flush(self) -> str:
        out, self._buffer = self._buffer, ""
        return "" if self.stopped else out

    def _held_tail_length(self) -> int:
        """Length of the longest suffix of the buffer that is a proper prefix of some stop string."""
        best = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(self._buffer)), best, -1):
                if self._buffer.endswith(stop[:n]):
                    best = n
                    break
        return best
