"""Output constraints of one request: a grammar (structured output) and a logit bias, applied to the target's raw
logits at every verified position, so speculation stays lossless under them.

The grammar comes from llguidance (the library behind vLLM's `guidance` backend; no dependencies, fast masks, and
a mask computation that walks a row's draft tokens and rolls itself back, made for speculative decoding). For a
row verifying [x0, d1..dK], the mask at position j is the grammar's state after the committed tokens plus d1..dj:
a draft token the grammar forbids has probability 0 there, so rejection sampling rejects it and resamples from the
masked target. Positions past a forbidden draft are unreachable and stay unmasked. The matcher then consumes
exactly the tokens the engine commits (engine._commit), so its state never runs ahead of the request's.

Why before penalties and temperature: OpenAI adds `logit_bias` to the logits "prior to sampling", and a masked
token must stay impossible whatever the later processing does; -inf survives every later step (penalties divide
or multiply it, temperature divides it, filters keep it out).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from services.verifier.sampling_params import OutputGrammar, SamplingParams

logger = logging.getLogger(__name__)

COMPILED_GRAMMARS_KEPT = 128  # the same schema sent again skips llguidance's (up to ~1 s) compilation
_BITS = torch.arange(32, dtype=torch.int32)

# OutputGrammar.kind -> llguidance's grammar_from format
_FORMATS = {"json_schema": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}
ANY_JSON_OBJECT = '{"type": "object"}'


class GrammarCompiler:
    """Turns a request's OutputGrammar into llguidance matchers for the target's tokenizer (built once: ~1 s)."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int) -> None:
        import llguidance
        import llguidance.hf

        self._llguidance = llguidance
        # The model's embedding table may be padded beyond the tokenizer: masks cover the model's vocabulary
        # (ids past the tokenizer's are never allowed by a grammar).
        self.vocab_size = vocab_size
        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=max(vocab_size, len(hf_tokenizer)))
        self.mask_words = (self.tokenizer.vocab_size + 31) // 32  # llguidance writes this many int32 per mask
        self.executor = llguidance.LLExecutor(num_threads=1)
        self._compiled: OrderedDict[OutputGrammar, str] = OrderedDict()
        self._warm_up()

    def _warm_up(self) -> None:
        """llguidance builds its token trie on the first mask (~0.5 s for a 49k vocabulary): here, at start-up,
        not in the first structured request's step, which every request in that batch would wait for."""
        import llguidance.numpy

        bitmask = torch.full((1, self.mask_words), -1, dtype=torch.int32)
        llguidance.numpy.fill_next_token_bitmask_par(self.executor, [(self.matcher(OutputGrammar("json_object")), 0)],
                                                     bitmask.numpy())

    def _grammar(self, spec: OutputGrammar) -> str:
        """llguidance's grammar text for `spec`; ValueError with llguidance's message when it does not compile."""
        cached = self._compiled.get(spec)
        if cached is not None:
            self._compiled.move_to_end(spec)
            return cached
        kind, text = (("json_schema", ANY_JSON_OBJECT) if spec.kind == "json_object" else (spec.kind, spec.text))
        try:
            grammar = self._llguidance.grammar_from(_FORMATS[kind], text)
        except (ValueError, TypeError) as error:  # e.g. a choice list that is not a JSON list of strings
            raise ValueError(f"structured_output ({spec.kind}) is invalid: {error}") from None
        problem = self._llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if problem and not problem.startswith("WARNING"):
            raise ValueError(f"structured_output ({spec.kind}) is invalid: {problem}")
        self._compiled[spec] = grammar
        if len(self._compiled) > COMPILED_GRAMMARS_KEPT:
            self._compiled.popitem(last=False)
        return grammar

    def matcher(self, spec: OutputGrammar) -> Any:
        matcher = self._llguidance.LLMatcher(self.tokenizer, self._grammar(spec))
        if matcher.is_error():
            raise ValueError(f"structured_output ({spec.kind}) is invalid: {matcher.get_error()}")
        return matcher


def grammar_compiler_for(hf_tokenizer: Any, vocab_size: int) -> GrammarCompiler | None:
    """The compiler, or None (logged) where llguidance cannot take this tokenizer (a slow, non-`tokenizers`
    one): the verifier then serves everything else and refuses structured output with a clear message."""
    from transformers import PreTrainedTokenizerFast

    if not isinstance(hf_tokenizer, PreTrainedTokenizerFast):
        logger.warning("structured output is unavailable: llguidance needs a fast (`tokenizers`) tokenizer, not %s",
                       type(hf_tokenizer).__name__)
        return None
    try:
        return GrammarCompiler(hf_tokenizer, vocab_size)
    except ValueError as error:
        logger.warning("structured output is unavailable with this tokenizer: %s", error)
        return None


@dataclass
class OutputConstraint:
    """One request's constraint; `matcher` is an llguidance LLMatcher (None: no grammar) made by `compiler`,
    `bias` a [V] tensor (None: no logit_bias)."""

    matcher: Any | None = None
    compiler: GrammarCompiler | None = None
    bias: torch.Tensor | None = None

    def commit(self, token: int) -> bool:
        """Advance the grammar over one committed token; True when the grammar is complete (nothing may follow).
        A token the mask allowed never fails; if one does, the request fails (RuntimeError), not the step."""
        if self.matcher is None:
            return False
        if not self.matcher.consume_token(token):
            raise RuntimeError(f"the grammar refused committed token {token}: {self.matcher.get_error()}")
        return self.matcher.is_stopped()


def build_constraint(sampling: SamplingParams, compiler: GrammarCompiler | None,
                     vocab_size: int) -> OutputConstraint | None:
    """At admission (ValueError for a grammar that does not compile); None for an unconstrained request."""
    if sampling.structured_output is None and not sampling.logit_bias:
        return None
    constraint = OutputConstraint()
    if sampling.structured_output is not None:
        if compiler is None:
            raise ValueError("structured output is unavailable on this server: llguidance could not take the "
                             "model's tokenizer (see the verifier's log)")
        constraint.matcher = compiler.matcher(sampling.structured_output)
        constraint.compiler = compiler
    if sampling.logit_bias:
        bias = torch.zeros(vocab_size, dtype=torch.float32)
        ids, values = zip(*sampling.logit_bias, strict=True)
        bias[list(ids)] = torch.tensor(values, dtype=torch.float32)
        constraint.bias = bias
    return constraint


def _allowed(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[N, W] int32 llguidance bitmask -> [N, V] bool."""
    bits = (bitmask[:, :, None] >> _BITS) & 1  # [N, W, 32]
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def constrain_logits(logits: torch.Tensor, constraints: Sequence[OutputConstraint | None],
                     drafts: Sequence[Sequence[int]]) -> None:
    """In place on [B, P, V] raw logits (row b verifies drafts[b]): add each row's bias, mask each grammar row at
    every position. Rows without a constraint cost nothing; a step without any costs one loop over the rows."""
    biased = [b for b, c in enumerate(constraints) if c is not None and c.bias is not None]
    if biased:
        bias = torch.stack([constraints[b].bias for b in biased]).to(logits.device)  # [N, V]
        logits[biased] += bias[:, None, :]
    grammar_rows = [b for b, c in enumerate(constraints) if c is not None and c.matcher is not None]
    if not grammar_rows:
        return
    import llguidance.numpy  # not llguidance.torch: importing it compiles a kernel (torch.compile, 1.7 s a process)

    compiler = constraints[grammar_rows[0]].compiler  # one per engine: every matcher shares its tokenizer

    positions = logits.shape[1]
    vocab = logits.shape[2]
    bitmask = torch.full((len(grammar_rows) * positions, compiler.mask_words), -1, dtype=torch.int32)
    jobs = [(constraints[b].matcher, i * positions, list(drafts[b])) for i, b in enumerate(grammar_rows)]
    with_drafts = [job for job in jobs if job[2]]
    if with_drafts:  # llguidance walks each row's drafts and rolls itself back
        llguidance.numpy.fill_next_token_bitmask_par_with_draft_tokens(compiler.executor, with_drafts, bitmask.numpy())
    without = [(matcher, index) for matcher, index, draft in jobs if not draft]
    if without:
        llguidance.numpy.fill_next_token_bitmask_par(compiler.executor, without, bitmask.numpy())
    allowed = _allowed(bitmask, vocab).reshape(len(grammar_rows), positions, vocab)
    if not allowed[:, 0].any(dim=-1).all():  # the committed state allows nothing: a grammar in error
        stuck = [grammar_rows[i] for i in (~allowed[:, 0].any(dim=-1)).nonzero().flatten().tolist()]
        raise RuntimeError(f"the grammar of batch rows {stuck} allows no next token")
    allowed |= ~allowed.any(dim=-1, keepdim=True)  # unreachable positions (past a forbidden draft): unmasked
    logits[grammar_rows] = logits[grammar_rows].masked_fill(~allowed.to(logits.device), float("-inf"))
