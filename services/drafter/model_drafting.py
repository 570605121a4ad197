"""Greedy drafting with a small causal LM through the model runner: the tensor work of the draft_model method.

Everything here runs on one thread (the proposer's compute thread) and is neither async nor thread-safe; the
proposer (methods/draft_model.py) owns that thread. One call drafts every sequence of an engine step together:

1. each sequence gets a KV slot in the runner (sequence_slots.py: least recently used eviction); a new one
   starts with the cached blocks of its tokens' longest cached prefix (the runner's prefix caching), so a prompt
   that starts like an earlier one (a chat's next turn, a shared system prompt) is not fed again;
2. its slot is truncated to the longest common prefix of the tokens it holds and the committed tokens ("set
   the length"), keeping at least one committed token to feed, since the last one's logits give the first draft;
3. one catch-up forward feeds every sequence's remaining committed tokens (usually the bonus token, or the last
   accepted draft and the bonus token; the whole prompt for a new or evicted sequence), batched. A long prefill
   is fed in chunks over several calls (CatchUpBudget), drafting nothing until it is through, so one call never
   holds the verifier's step past its draft deadline;
4. then one batched forward per draft position, one argmax token per row still drafting (rows asking fewer
   tokens drop out), so K tokens cost K forwards whatever the number of sequences.

The tokens fed while drafting stay in the slot: when the verifier accepts them, the next call finds them in the
common prefix and does not feed them again.

With pipelining (draft_pipelining.py), `predraft` runs right after a call, on the guess that its drafts are
accepted whole, and the next call answers from it when the guess held.

Sequences that cannot be drafted get an empty draft, never an error: K of 0, no committed token, longer than the
runner's max_model_len (K is also clamped so the drafts fit), a token id outside the draft model's vocabulary,
or no free slot because every slot belongs to a sequence of the same call.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

import numpy as np

from services.drafter.draft_pipelining import PreDraft, PreDrafts
from services.drafter.sequence_slots import SequenceSlots, common_prefix_length
from services.modeling.runner import ModelRunner, RowInput

# A catch-up forward is padded to its longest row. Below this many token positions in all, a forward costs
# about the same however wide it is (reading the weights dominates), so rows are batched freely; above it, a
# row joins a batch only while padding at most doubles the tokens computed (a prompt being prefilled does not
# make every decoding row pay for its length).
FREE_PADDING_TOKENS = 64


# A call feeds at most about this many seconds of catch-up tokens (at the rate measured on the long feeds so far),
# well inside the verifier's default draft deadline of 0.5 s, which a draft model's whole-prompt prefill on a CPU
# can exceed. Feeds of a few tokens (the steady state) are never cut.
CATCH_UP_SECONDS = 0.25
MIN_CATCH_UP_TOKENS = 32  # a chunk never shrinks below this; forwards this long also measure the rate


@dataclass
class CatchUpBudget:
    """Token positions one call may feed into the draft model, from the measured prefill rate: unbounded until a
    feed of at least MIN_CATCH_UP_TOKENS has been timed (a GPU's budget stays far above any prompt), then
    `seconds` at the slowest recent rate. Rates are measured, not configured, so every device sizes its own."""

    seconds: float = CATCH_UP_SECONDS
    tokens_per_s: float | None = None  # None: not measured yet
    clock: Callable[[], float] = field(default=time.perf_counter, repr=False)

    def limit(self) -> int | None:
        """Tokens a call may feed; None: no limit."""
        if self.tokens_per_s is None:
            return None
        return max(MIN_CATCH_UP_TOKENS, int(self.seconds * self.tokens_per_s))

    def observe(self, tokens: int, seconds: float) -> None:
        """A catch-up forward of `tokens` positions took `seconds`; short ones are dominated by reading weights."""
        if tokens < MIN_CATCH_UP_TOKENS or seconds <= 0:
            return
        rate = tokens / seconds
        # Leaning toward the slower figure: a chunk that runs long costs a missed deadline, one that runs short
        # only an extra call.
        self.tokens_per_s = rate if self.tokens_per_s is None else min(rate, 0.5 * (rate + self.tokens_per_s))


@dataclass(frozen=True)
class DraftRequest:
    """One sequence of a call: its committed tokens (a snapshot the caller no longer changes) and K."""

    seq_id: Hashable
    token_ids: np.ndarray  # int64, prompt first
    num_speculative_tokens: int


class ModelDrafter:
    def __init__(self, runner: ModelRunner, catch_up: CatchUpBudget | None = None) -> None:
        """`runner` must hold no sequences: its slots are this drafter's to give out."""
        if runner.num_free_slots() != runner.max_num_seqs:
            raise ValueError("the draft model's runner must start empty")
        self.runner = runner
        self.slots = SequenceSlots(runner.max_num_seqs)
        self.catch_up = catch_up if catch_up is not None else CatchUpBudget()
        self.predrafts = PreDrafts()

    def measure_catch_up(self, num_tokens: int = 4 * MIN_CATCH_UP_TOKENS, repeats: int = 2) -> None:
        """Time a prefill of `num_tokens` (the first one warms up) so that the first prompt is already fed in
        chunks; call before serving, with a slot free."""
        num_tokens = max(MIN_CATCH_UP_TOKENS, min(num_tokens, self.runner.max_model_len))
        probe = ("specserve-catch-up-probe",)
        tokens = [(7 * i + 1) % self.runner.vocab_size for i in range(num_tokens)]
        for attempt in range(repeats):
            self.runner.add_sequence(probe)
            try:
                started = self.catch_up.clock()
                self.runner.forward([RowInput(probe, tokens, 1)]).logits.argmax(dim=-1).tolist()
                seconds = self.catch_up.clock() - started
            finally:
                self.runner.remove_sequence(probe)
            if attempt > 0 or repeats == 1:
                self.catch_up.observe(num_tokens, seconds)

    def forget(self, seq_id: Hashable) -> None:
        """Free the sequence's slot, if it holds one."""
        self.predrafts.forget(seq_id)
        if self.slots.drop(seq_id):
            self.runner.remove_sequence(seq_id)

    def draft(self, requests: Sequence[DraftRequest]) -> list[tuple[int, ...]]:
        """Up to K argmax tokens per request, in order; () where it cannot be drafted (module docstring)."""
        drafts: list[tuple[int, ...]] = [()] * len(requests)
        chosen = self._draftable(requests)
        ready = {}  # pre-drafts whose guess held: the very drafts this call would compute (draft_pipelining.py)
        for i in chosen:
            tokens = self.predrafts.take(requests[i].seq_id, requests[i].token_ids, self._room(requests[i]))
            if tokens:
                ready[i] = drafts[i] = tokens
        assignment = self.slots.assign([requests[i].seq_id for i in chosen])
        for seq_id in assignment.evicted:
            self.predrafts.forget(seq_id)
            self.runner.remove_sequence(seq_id)
        by_id = {requests[i].seq_id: requests[i] for i in chosen}
        for seq_id in assignment.admitted:  # from the longest cached prefix of its tokens (prefix caching)
            tokens = by_id[seq_id].token_ids
            cached = self.runner.add_sequence(seq_id, tokens.tolist())
            if cached:
                self.slots.set_tokens(seq_id, tokens[:cached])
        refused = set(assignment.refused)
        rows = [i for i in chosen if requests[i].seq_id not in refused and i not in ready]
        if not rows:
            return drafts
        try:
            wanted = [self._feed(requests[i]) for i in rows]
            feeds = chunk_feeds(wanted, self.catch_up.limit())
            complete = [len(feed) == len(whole) for feed, whole in zip(feeds, wanted, strict=True)]
            ks = [self._room(requests[i]) if done else 0 for i, done in zip(rows, complete, strict=True)]
            proposed = self._draft_rows([requests[i].seq_id for i in rows], feeds, ks)
        except BaseException:
            for i in rows:  # what the slots hold is unknown now: start these sequences afresh next time
                self.forget(requests[i].seq_id)
            raise
        for i, feed, whole, done, tokens in zip(rows, feeds, wanted, complete, proposed, strict=True):
            request = requests[i]
            if not done:  # a chunk of its prefill: the slot holds what was fed, no draft yet
                fed_until = len(request.token_ids) - len(whole) + len(feed)
                self.slots.set_tokens(request.seq_id, request.token_ids[:fed_until])
                continue
            fed = np.asarray(tokens[:-1], dtype=np.int64)  # the last draft is never fed
            self.slots.set_tokens(request.seq_id, np.concatenate([request.token_ids, fed]))
            drafts[i] = tuple(tokens)
        return drafts

    def predraft(self, requests: Sequence[DraftRequest], drafts: Sequence[tuple[int, ...]],
                 stop: Callable[[], bool] = lambda: False) -> None:
        """Draft each sequence's next step now, on the guess that `drafts` (this call's answer to `requests`) are
        accepted whole and the verifier's bonus token is the draft model's own next argmax: feed d_K, take that
        argmax g, then draft K after it, for the committed tokens committed + d + g (draft_pipelining.py).
        `stop` is asked between forwards: a new call is waiting, so the rest is left to it."""
        started = self.catch_up.clock()
        rows = [i for i, draft in enumerate(drafts) if draft and requests[i].seq_id in self.slots]
        rows = [i for i in rows if self._next_room(requests[i], drafts[i]) > 0]
        if not rows or stop():
            return
        seq_ids = [requests[i].seq_id for i in rows]
        ks = [self._next_room(requests[i], drafts[i]) for i in rows]
        fed: list[list[int]] = [[] for _ in rows]  # fed after what each slot held: committed + d1..d(K-1)
        feeding = [drafts[i][-1] for i in rows]
        guesses: list[int] = []
        chains: list[list[int]] = [[] for _ in rows]
        try:
            for position in range(max(ks) + 1):
                active = [b for b, k in enumerate(ks) if position <= k]
                logits = self.runner.forward([RowInput(seq_ids[b], [feeding[b]], 1) for b in active]).logits
                for b, token in zip(active, logits[:, 0].argmax(dim=-1).tolist(), strict=True):
                    fed[b].append(feeding[b])
                    if position == 0:
                        guesses.append(int(token))
                    else:
                        chains[b].append(int(token))
                    feeding[b] = int(token)
                if position < max(ks) and stop():
                    break
        except BaseException:
            for seq_id in seq_ids:  # what the slots hold is unknown now: start these sequences afresh next time
                self.forget(seq_id)
            raise
        seconds = (self.catch_up.clock() - started) / len(rows)  # each row's share of the batched forwards
        for b, i in enumerate(rows):
            held = np.asarray([*drafts[i][:-1], *fed[b]], dtype=np.int64)
            self.slots.set_tokens(seq_ids[b], np.concatenate([requests[i].token_ids, held]))
            if len(chains[b]) < ks[b]:
                self.predrafts.stopped()
                continue
            base = np.concatenate([requests[i].token_ids, np.asarray([*drafts[i], guesses[b]], dtype=np.int64)])
            self.predrafts.keep(seq_ids[b], PreDraft(base, tuple(chains[b]), seconds))

    def _next_room(self, request: DraftRequest, draft: tuple[int, ...]) -> int:
        """K of the next step, when its committed tokens are these plus the draft and a bonus token."""
        base = len(request.token_ids) + len(draft) + 1
        return min(request.num_speculative_tokens, self.runner.max_model_len - base + 1)

    def _room(self, request: DraftRequest) -> int:
        """K clamped so that the committed tokens and the K - 1 drafts fed after them fit in a slot."""
        length = len(request.token_ids)
        return min(request.num_speculative_tokens, self.runner.max_model_len - length + 1) if length else 0

    def _draftable(self, requests: Sequence[DraftRequest]) -> list[int]:
        """Indices of the requests to draft. A sequence that will never fit (too long, or ids the draft model
        does not have) also gives its slot back."""
        chosen, seen = [], set()
        for i, request in enumerate(requests):
            tokens = request.token_ids
            fits = len(tokens) <= self.runner.max_model_len and (
                not len(tokens) or (int(tokens.min()) >= 0 and int(tokens.max()) < self.runner.vocab_size)
            )
            if not fits:
                self.forget(request.seq_id)
            elif self._room(request) > 0 and request.seq_id not in seen:
                chosen.append(i)
                seen.add(request.seq_id)
        return chosen

    def _feed(self, request: DraftRequest) -> list[int]:
        """Set the slot's length to what it can keep of the committed tokens; returns the tokens to feed."""
        committed = request.token_ids
        keep = min(common_prefix_length(self.slots.tokens(request.seq_id), committed), len(committed) - 1)
        self.runner.truncate(request.seq_id, keep)
        return committed[keep:].tolist()

    def _draft_rows(self, seq_ids: list[Hashable], feeds: list[list[int]], ks: list[int]) -> list[list[int]]:
        """Feed each row's tokens, then draft ks[b] tokens for row b (0: feed only)."""
        drafts: list[list[int]] = [[] for _ in seq_ids]
        fed = [b for b, feed in enumerate(feeds) if feed]  # a prefill that got no chunk this call waits
        for chunk in catch_up_batches([len(feeds[b]) for b in fed]):
            batch = [fed[j] for j in chunk]
            started = self.catch_up.clock()
            logits = self.runner.forward([RowInput(seq_ids[b], feeds[b], 1) for b in batch]).logits
            tokens = logits[:, 0].argmax(dim=-1).tolist()  # reading them waits for the forward (CUDA included)
            self.catch_up.observe(sum(len(feeds[b]) for b in batch), self.catch_up.clock() - started)
            for b, token in zip(batch, tokens, strict=True):
                drafts[b].append(int(token))
        for position in range(1, max(ks)):
            active = [b for b, k in enumerate(ks) if k > position]
            logits = self.runner.forward([RowInput(seq_ids[b], [drafts[b][-1]], 1) for b in active]).logits
            for b, token in zip(active, logits[:, 0].argmax(dim=-1).tolist(), strict=True):
                drafts[b].append(int(token))
        return drafts


def chunk_feeds(feeds: Sequence[list[int]], limit: int | None) -> list[list[int]]:
    """The feeds cut to `limit` token positions in all (None: uncut). Short feeds (a decoding sequence's one or
    two tokens) always go whole and first; the long ones (prefills) share what is left in order, and one that is
    cut drafts nothing this call. At least one prefill always gets a chunk, so every sequence gets through."""
    if limit is None:
        return [list(feed) for feed in feeds]
    out: list[list[int]] = [[] for _ in feeds]
    left = limit
    long_rows = []
    for b, feed in enumerate(feeds):
        if len(feed) < MIN_CATCH_UP_TOKENS:
            out[b] = list(feed)
            left -= len(feed)
        else:
            long_rows.append(b)
    for n, b in enumerate(long_rows):
        take = max(left, MIN_CATCH_UP_TOKENS if n == 0 else 0)
        out[b] = list(feeds[b][:take])
        left -= len(out[b])
    return out


def catch_up_batches(lengths: Sequence[int]) -> list[list[int]]:
    """Rows (indices into `lengths`) grouped into catch-up forwards, longest first. In the steady state (every
    row feeds one or two tokens) that is one forward; a long prefill is batched only with rows that do not more
    than double its padded size (FREE_PADDING_TOKENS)."""
    batches: list[list[int]] = []
    width = real = 0
    for row in sorted(range(len(lengths)), key=lambda b: -lengths[b]):
        n = lengths[row]
        if batches:
            padded = (len(batches[-1]) + 1) * width
            if padded <= FREE_PADDING_TOKENS or padded <= 2 * (real + n):
                batches[-1].append(row)
                real += n
                continue
        batches.append([row])
        width, real = n, n
    return batches
