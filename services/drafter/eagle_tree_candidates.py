"""EAGLE-2's deterministic tree as fixed-shape tensor work: every candidate node of `depth` levels of `topk`
expansions, with its parent and its path's log-probability, computed on the head's device with no host sync, so
that an accelerator replays a whole tree as one captured graph (eagle_head_graphs.py). The host then keeps each
sequence's likeliest nodes (eagle_trees.sent_trees), from one copy of the result.

Why: the tree was drafted level by level in Python. Each level read its top-k on the host, then copied every
expansion's committed cache and the K/V above it into a padded batch. One sequence's tree (24 nodes, top-8,
depth 4) was 1,264 tensor operations and eight sequences' 5,590 (counted on CPU with a dispatch mode), each a
kernel launch on a GPU, where a chain of 4 replays as one graph.

The shapes depend only on (rows, committed span, topk, depth):
- level 0 expands the root (each sequence's last committed token) into its topk children: nodes 0..topk-1;
- level l >= 1 expands topk nodes of level l-1 (the likeliest by path probability; at level 1 all of level 0)
  into topk children each: a block of topk x topk nodes, listed by the expanded node's rank, then by child rank;
- each expansion is one query of one batched head step (EagleHead.step_tree) that reads the sequence's committed
  cache and a tree buffer after it: the root's K/V in its first slot, then each level's topk expansions'. An
  expansion sees the slots of its ancestors and its own, as the chain along its path would.
A node whose token is past the target's vocabulary is never sent, nor is anything below it (`valid`); it is
never expanded while a valid node of its level waits. With a float32 head this is the tree eagle_trees.py
drafted before, node for node, but for the order of exactly tied path probabilities; a half-precision head's
nodes are now ranked by float32 log-probabilities, where before each level's were rounded to its precision.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from services.drafter.eagle_head_graphs import ChainInputs, with_room
from services.modeling.eagle_head import DraftRows


def tree_candidates(head, embed: torch.nn.Module, draft_rows: DraftRows, inputs: ChainInputs, topk: int,
                    depth: int, vocab_size: int) -> torch.Tensor:
    """Every candidate node of each row's tree (topk, then topk x topk a level: N of them), packed as float32
    [B, 4, N] (one copy to the host): target token ids, parents (node indices, -1 under the root), path log-probabilities (summed in
    float32), and 1 where the node may be sent. Ids and parents are exact in float32 below 2^24."""
    topk = min(topk, draft_rows.weight.shape[0])
    rows, span = inputs.mask.shape
    device = inputs.mask.device
    slots = tree_columns(topk, depth)
    keys, values = (with_room(kv, span, slots) for kv in (inputs.keys, inputs.values))  # [B, kv heads, W, D]
    visible = F.pad(inputs.mask, (0, slots))
    visible[:, span] = True
    visible = visible[:, None]  # [B, 1, W]: the root sees the committed positions and itself
    # every level's RoPE angles at once (level l's nodes sit at the root's position + l): one launch, not depth
    cos, sin = head.rotary.angles(inputs.positions[:, None] + torch.arange(depth, device=device), keys.dtype)
    out = head.step_tree(embed(inputs.tokens[:, None]), inputs.features, inputs.positions[:, None], keys, values,
                         visible, span, (cos[:, :, :1], sin[:, :, :1]))
    ids, scores = _children(head, draft_rows, out, topk)  # [B, 1, topk] each
    tokens, log_probs = ids.flatten(1), scores.flatten(1)
    valid = tokens < vocab_size
    parents = torch.full_like(tokens, -1)
    level_start, expanded_outs = 0, out.expand(rows, topk, out.shape[-1])  # level 1's parents: all the root
    for level in range(1, depth):
        if level == 1:  # every node of level 0
            frontier = torch.arange(topk, device=device).expand(rows, topk)  # [B, topk] node indices
            features, seen = expanded_outs, visible.expand(rows, topk, visible.shape[-1])
        else:  # the likeliest valid nodes of level - 1, and the expansion that drafted each
            ranked = log_probs[:, level_start:].masked_fill(~valid[:, level_start:], float("-inf"))
            chosen = ranked.topk(topk).indices
            frontier = level_start + chosen
            by = chosen // topk
            features = expanded_outs.gather(1, by[..., None].expand(-1, -1, expanded_outs.shape[-1]))
            seen = visible.gather(1, by[..., None].expand(-1, -1, visible.shape[-1]))
        slot = span + 1 + (level - 1) * topk
        own = torch.zeros_like(seen)
        own[:, :, slot : slot + topk] = torch.eye(topk, dtype=torch.bool, device=device)
        visible = seen | own
        positions = (inputs.positions[:, None] + level).expand(rows, topk)
        expanded_outs = head.step_tree(embed(tokens.gather(1, frontier)), features, positions, keys, values,
                                       visible, slot, (cos[:, :, level : level + 1], sin[:, :, level : level + 1]))
        ids, scores = _children(head, draft_rows, expanded_outs, topk)  # [B, topk, topk]
        base, base_valid = log_probs.gather(1, frontier), valid.gather(1, frontier)
        level_start = tokens.shape[1]
        tokens = torch.cat([tokens, ids.flatten(1)], dim=1)
        log_probs = torch.cat([log_probs, (base[..., None] + scores).flatten(1)], dim=1)
        valid = torch.cat([valid, (base_valid[..., None] & (ids < vocab_size)).flatten(1)], dim=1)
        parents = torch.cat([parents, frontier.repeat_interleave(topk, dim=1)], dim=1)
    return torch.stack([tokens.float(), parents.float(), log_probs.float(), valid.float()], dim=1)


def tree_columns(topk: int, depth: int) -> int:
    """The head positions a tree's expansions write after the committed ones: the root's, then each expanding
    level's topk."""
    return 1 + topk * (depth - 1)


def _children(head, draft_rows: DraftRows, outputs: torch.Tensor, topk: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each output's topk likeliest next tokens (target ids) and their log-probabilities under the head, in
    float32 whatever the head's precision: paths are ranked by sums of them, which bf16 would round to about two
    digits."""
    log_probs = torch.log_softmax(head.draft_scores(outputs, draft_rows).float(), dim=-1)
    top = log_probs.topk(topk, dim=-1)
    return head.token_ids(top.indices), top.values
