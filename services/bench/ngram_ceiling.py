"""`python -m services.bench.ngram_ceiling`: how many tokens a verify step could commit with prompt lookup on the
code edit, from the target's own greedy answer, in each dtype asked for: the ceiling of what ngram speculation can
give there, before any step costs.

Greedy verification commits a draft's tokens up to its first mismatch with the target's greedy answer, then the
target's own token. So given that answer, the tokens per step that ngram (services/drafter/methods/ngram.py) would
reach at K and its lookup lengths are computed here without an engine: propose from the committed text, commit
the matching run and one more, repeat. Speculation's speedup on the edit is at most these tokens a step times what
a decode step costs over what a verify step costs; where the ceiling is under a target, no step cost meets it.

Why it exists: SmolLM2-135M answers the edit differently in float32 and in bfloat16 (greedy: the same prompt, other
rounding), and in bfloat16 it stops copying the file after a few lines, which is what ngram drafts from.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import numpy as np
import torch

from services.bench.hardware import describe_hardware
from services.bench.prompts import chat_token_ids, code_edit_message
from services.drafter.methods.ngram import NgramSettings, propose_ngram
from services.modeling.loading import load_model
from services.modeling.registry import DEFAULT_MODEL

LOOKUPS = ((1, 4), (1, 8), (2, 4))  # (prompt_lookup_min, prompt_lookup_max); (1, 4) is the drafter's default


def steps_to_commit(prompt: Sequence[int], answer: Sequence[int], k: int, settings: NgramSettings
                    ) -> tuple[int, int]:
    """(verify steps, steps without a draft) that greedy speculation with ngram at `k` takes to commit `answer`."""
    committed, done, steps, empty = list(prompt), 0, 0, 0
    while done < len(answer):
        draft = propose_ngram(np.asarray(committed, dtype=np.int64), k, settings)
        empty += not draft
        matched = 0
        while matched < len(draft) and done + matched < len(answer) and draft[matched] == answer[done + matched]:
            matched += 1
        taken = min(matched + 1, len(answer) - done)  # the matching run and the target's own next token
        committed += answer[done : done + taken]
        done += taken
        steps += 1
    return steps, empty


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.bench.ngram_ceiling", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--max-tokens", type=int, default=128, help="the answer's length (accelerator_step's)")
    parser.add_argument("--k", type=int, nargs="+", default=[4, 8, 16])
    args = parser.parse_args(argv)
    for key, value in describe_hardware().items():
        print(f"{key}: {value}")
    for dtype in args.dtypes:
        loaded = load_model(args.model, device=args.device, dtype=dtype)
        prompt = list(chat_token_ids(loaded.tokenizer, code_edit_message()))
        with torch.inference_mode():
            ids = torch.tensor([prompt], device=loaded.device)
            output = loaded.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_tokens,
                                           do_sample=False)
        answer = output[0, len(prompt):].tolist()
        print(f"\n{loaded.model_id} on {loaded.device} in {dtype}: the code edit's greedy answer, {len(answer)} "
              f"tokens after a {len(prompt)}-token prompt, begins")
        print("  " + "\n  ".join(loaded.tokenizer.decode(answer).splitlines()[:8]))
        for low, high in LOOKUPS:
            settings = NgramSettings(low, high)
            cells = []
            for k in args.k:
                steps, empty = steps_to_commit(prompt, answer, k, settings)
                cells.append(f"K = {k}: {len(answer) / steps:.2f} ({empty} of {steps} steps without a draft)")
            print(f"  lookup {low}-{high}: tokens a step " + "; ".join(cells))
        del loaded
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
