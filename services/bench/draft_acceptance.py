"""`python -m services.bench.draft_acceptance`: would sending the draft model's distribution q pay for its bytes?

The draft_model drafter drafts by argmax and sends token ids only; the verifier then accepts a draft token x with
probability p(x) (the one-hot rule), where p is the target's distribution at the request's temperature. A drafter
that samples x from q and sends q gets x accepted with probability min(1, p(x)/q(x)), i.e. sum_x min(p, q) on
average (1 - total variation distance). This measures both per position, teacher-forced on text the target itself
samples at each temperature (so the positions are the ones a sampled request visits), on HumanEval prompts:

- argmax drafting: E[p(argmax q)];
- sampled drafting with q: E[sum_x min(p(x), q(x))];

and what each means for the tokens a verify step yields at K (positions assumed independent:
(1 - a^(K+1)) / (1 - a)), against the bytes q costs on the link: vocabulary x K x 2 bytes (fp16) per sequence and
step. At temperature 0 both rules accept exactly when the argmax agrees, so sampling can only matter above 0.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Sequence

import torch

from services.bench.prompts import chat_token_ids, humaneval_messages
from services.modeling.loading import load_model


def expected_tokens_per_step(acceptance: float, k: int) -> float:
    """Tokens one verify step yields with K drafts when each is accepted with probability `acceptance` (the
    bonus token included): 1 + a + a^2 + ... + a^K."""
    return sum(acceptance**i for i in range(k + 1))


@torch.inference_mode()
def position_acceptance(target, draft, prompt: Sequence[int], new_tokens: int, temperature: float, seed: int):
    """(argmax rule, sampled rule) acceptance at every position of a continuation the target samples."""
    torch.manual_seed(seed)
    ids = torch.tensor([list(prompt)])
    text = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=True,
                           temperature=temperature, top_k=0, top_p=1.0)
    start = len(prompt) - 1  # logits at position i predict token i + 1: from the last prompt token on
    p = torch.softmax(target(text).logits[0, start:-1].float() / temperature, dim=-1)
    q = torch.softmax(draft(text).logits[0, start:-1, : p.shape[-1]].float() / temperature, dim=-1)
    argmax_rule = p.gather(-1, q.argmax(dim=-1, keepdim=True)).squeeze(-1)
    sampled_rule = torch.minimum(p, q).sum(dim=-1)
    return argmax_rule.tolist(), sampled_rule.tolist()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.bench.draft_acceptance", description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct")
    parser.add_argument("--draft", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--num-prompts", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.7, 1.0])
    parser.add_argument("--k", type=int, default=5)
    args = parser.parse_args(argv)
    target = load_model(args.target, device="cpu", dtype="float32")
    draft = load_model(args.draft, device="cpu", dtype="float32")
    prompts = [chat_token_ids(target.tokenizer, m) for m in humaneval_messages(args.num_prompts)]
    vocab = target.model.config.vocab_size
    print(f"target {target.model_id}, draft {draft.model_id}; {len(prompts)} HumanEval prompts, {args.new_tokens} "
          f"tokens sampled by the target per prompt; K = {args.k}")
    print("| temperature | positions | argmax drafts: acceptance | sampled drafts with q | tokens/step at K, "
          "argmax | with q | q bytes per sequence and step (fp16) |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for temperature in args.temperatures:
        argmax_all, sampled_all = [], []
        for i, prompt in enumerate(prompts):
            a, s = position_acceptance(target.model, draft.model, prompt, args.new_tokens, temperature, seed=i)
            argmax_all += a
            sampled_all += s
        a, s = statistics.fmean(argmax_all), statistics.fmean(sampled_all)
        print(f"| {temperature} | {len(argmax_all)} | {a:.3f} | {s:.3f} | {expected_tokens_per_step(a, args.k):.2f} "
              f"| {expected_tokens_per_step(s, args.k):.2f} | {vocab * args.k * 2 / 2**20:.2f} MiB |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
