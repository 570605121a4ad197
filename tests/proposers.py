"""Proposers used by tests: adversarial (random tokens), perfect (an oracle of the target's own output) and
sampling drafters that send q. They implement the same Proposer protocol as the real drafters."""

from __future__ import annotations

import random
from collections.abc import Hashable, Mapping, Sequence

import torch

from services.common.proposer import Draft, DraftInput, ProposerCapabilities


class RandomProposer:
    """Proposes uniformly random tokens: almost everything is rejected."""

    method = "random"

    def __init__(self, vocab_size: int, seed: int = 0) -> None:
        self.vocab_size = vocab_size
        self.rng = random.Random(seed)

    async def propose(self, inputs: Sequence[DraftInput]) -> list[Draft]:
        return [
            Draft([self.rng.randrange(self.vocab_size) for _ in range(item.num_speculative_tokens)])
            for item in inputs
        ]

    def release(self, seq_id: Hashable) -> None:
        pass


class EmptyProposer:
    """Never has a draft, as an n-gram drafter on new text; counts the calls it gets."""

    method = "empty"

    def __init__(self) -> None:
        self.capabilities = ProposerCapabilities()
        self.calls = 0

    async def propose(self, inputs: Sequence[DraftInput]) -> list[Draft]:
        self.calls += 1
        return [Draft(()) for _ in inputs]

    def release(self, seq_id: Hashable) -> None:
        pass


class OracleProposer:
    """Proposes the continuation of a known reference sequence: 100% acceptance when the reference is the
    target's own greedy output."""

    method = "oracle"

    def __init__(self, references: Mapping[Hashable, Sequence[int]]) -> None:
        self.references = references

    async def propose(self, inputs: Sequence[DraftInput]) -> list[Draft]:
        drafts = []
        for item in inputs:
            reference = list(self.references[item.seq_id])
            n = len(item.token_ids)
            assert reference[:n] == list(item.token_ids), "sequence diverged from the reference"
            drafts.append(Draft(reference[n : n + item.num_speculative_tokens]))
        return drafts

    def release(self, seq_id: Hashable) -> None:
        pass


class ModelSamplingProposer:
    """Samples K tokens autoregressively from a (tiny) draft model at a temperature and optionally sends q.

    With the target itself as the draft model acceptance is high; with an unrelated model it is low.
    """

    def __init__(self, model: torch.nn.Module, temperature: float, send_q: bool, seed: int, method: str) -> None:
        self.model = model
        self.temperature = temperature
        self.send_q = send_q
        self.generator = torch.Generator().manual_seed(seed)
        self.method = method

    async def propose(self, inputs: Sequence[DraftInput]) -> list[Draft]:
        drafts: list[Draft | None] = [None] * len(inputs)
        by_length: dict[tuple[int, int], list[int]] = {}
        for i, item in enumerate(inputs):  # equal lengths share one batched draft-model forward
            by_length.setdefault((len(item.token_ids), item.num_speculative_tokens), []).append(i)
        for (_, k), members in by_length.items():
            for i, draft in zip(members, self._draft([list(inputs[i].token_ids) for i in members], k), strict=True):
                drafts[i] = draft
        return drafts

    @torch.inference_mode()
    def _draft(self, sequences: list[list[int]], k: int) -> list[Draft]:
        tokens = torch.tensor(sequences)  # [B, T]
        proposed, probs = [], []
        for _ in range(k):
            logits = self.model(input_ids=torch.cat([tokens, *proposed], dim=1)).logits[:, -1].float()
            q = torch.softmax(logits / self.temperature, dim=-1)  # [B, V]
            proposed.append(torch.multinomial(q, 1, generator=self.generator))  # [B, 1]
            probs.append(q)
        drafted = torch.cat(proposed, dim=1).tolist() if k else [[] for _ in sequences]
        q_all = torch.stack(probs, dim=1) if k else None  # [B, K, V]
        return [Draft(row, q_all[b] if self.send_q and q_all is not None else None) for b, row in enumerate(drafted)]

    def release(self, seq_id: Hashable) -> None:
        pass


class ModelSamplingTreeProposer:
    """Samples token trees from a (tiny) draft model, as a drafter that sends q-trees must (Draft.parents): each
    node gets `branch` children drawn without replacement (Gumbel top-k) from the model at a temperature, listed in
    draw order, breadth first up to K nodes, and q per node is its parent's distribution. `drawn_from` names
    another temperature the tokens are really drawn from while q still says `temperature`: a lying drafter."""

    capabilities = ProposerCapabilities(sends_trees=True)

    def __init__(self, model: torch.nn.Module, temperature: float, branch: int, send_q: bool, seed: int,
                 method: str = "qtree", drawn_from: float | None = None) -> None:
        self.model = model
        self.temperature = temperature
        self.drawn_from = drawn_from
        self.branch = branch
        self.send_q = send_q
        self.generator = torch.Generator().manual_seed(seed)
        self.method = method

    async def propose(self, inputs: Sequence[DraftInput]) -> list[Draft]:
        return self._trees([list(item.token_ids) for item in inputs], [item.num_speculative_tokens for item in inputs])

    @torch.inference_mode()
    def _trees(self, contexts: list[list[int]], limits: list[int]) -> list[Draft]:
        """All sequences' trees level by level, one draft-model forward per sequence length a level."""
        tokens: list[list[int]] = [[] for _ in contexts]
        parents: list[list[int]] = [[] for _ in contexts]
        rows: list[list[torch.Tensor]] = [[] for _ in contexts]
        frontier = [(b, -1, []) for b, k in enumerate(limits) if k > 0]  # (sequence, node, its path)
        while frontier:
            by_length: dict[int, list[tuple[int, int, list[int]]]] = {}
            for entry in frontier:
                by_length.setdefault(len(contexts[entry[0]]) + len(entry[2]), []).append(entry)
            frontier = []
            for group in by_length.values():
                logits = self.model(input_ids=torch.tensor([contexts[b] + path for b, _, path in group])).logits
                for (b, node, path), row in zip(group, logits[:, -1].float(), strict=True):
                    drawn = torch.log_softmax(row / (self.drawn_from or self.temperature), dim=-1)
                    noise = -torch.log(-torch.log(torch.rand(row.shape, generator=self.generator)))
                    for token in (drawn + noise).topk(self.branch).indices.tolist()[: limits[b] - len(tokens[b])]:
                        tokens[b].append(token)
                        parents[b].append(node)
                        rows[b].append(torch.softmax(row / self.temperature, dim=-1))
                        frontier.append((b, len(tokens[b]) - 1, path + [token]))
        return [Draft(t, torch.stack(r) if self.send_q and r else None, p)
                for t, p, r in zip(tokens, parents, rows, strict=True)]

    def release(self, seq_id: Hashable) -> None:
        pass


class FailingProposer:
    """Raises, or sleeps past any deadline: the engine must fall back to K = 0 and stay correct."""

    def __init__(self, method: str, mode: str) -> None:
        self.method = method
        self.mode = mode
        self.calls = 0

    async def propose(self, inputs: Sequence[DraftInput]) -> list[Draft]:
        import asyncio

        self.calls += 1
        if self.mode == "raise":
            raise ConnectionError("drafter unavailable")
        await asyncio.sleep(3600)
        return []

    def release(self, seq_id: Hashable) -> None:
        pass


class TreeProposer:
    """Sends token trees of K nodes: random branches (duplicate siblings included) and, with `references`, the
    reference continuation as one branch placed after the others, so that accepting it moves K/V into place.
    Parents come before children, as the protocol asks. `ranked`: path probabilities that rank the reference
    branch first (0.9 a node, the random ones 0.05), as a drafter that knows its likeliest branch would."""

    method = "tree"
    capabilities = ProposerCapabilities(sends_trees=True)

    def __init__(self, vocab_size: int, seed: int = 0,
                 references: Mapping[Hashable, Sequence[int]] | None = None, ranked: bool = False,
                 duplicate_share: float = 0.3) -> None:
        self.vocab_size = vocab_size
        self.ranked = ranked
        self.duplicate_share = duplicate_share  # of the nodes that have siblings, those repeating a sibling's token
        self.rng = random.Random(seed)
        self.references = references
        self.calls = 0

    async def propose(self, inputs: Sequence[DraftInput]) -> list[Draft]:
        self.calls += 1
        return [self._tree(item) for item in inputs]

    def _tree(self, item: DraftInput) -> Draft:
        k = item.num_speculative_tokens
        true_path: list[int] = []
        if self.references is not None:
            reference = list(self.references[item.seq_id])
            true_path = reference[len(item.token_ids) : len(item.token_ids) + max(1, k // 2)]
        tokens: list[int] = []
        parents: list[int] = []
        while len(tokens) < k - len(true_path):
            parent = self.rng.randint(-1, len(tokens) - 1)
            siblings = [tokens[j] for j in range(len(tokens)) if parents[j] == parent]
            duplicate = siblings and self.rng.random() < self.duplicate_share
            if duplicate:
                tokens.append(self.rng.choice(siblings))
            elif self.duplicate_share:  # a random token, which may repeat a sibling's by chance
                tokens.append(self.rng.randrange(self.vocab_size))
            else:
                tokens.append(self.rng.choice([t for t in range(self.vocab_size) if t not in siblings]))
            parents.append(parent)
        random_nodes = len(tokens)
        for depth, token in enumerate(true_path):
            parent = -1 if depth == 0 else len(tokens) - 1
            if not self.duplicate_share and token in [t for t, p in zip(tokens, parents, strict=True) if p == parent]:
                break  # a random sibling has the reference's token already
            parents.append(parent)
            tokens.append(token)
        path_probs = [0.05] * random_nodes + [0.9] * (len(tokens) - random_nodes) if self.ranked else None
        return Draft(tokens, parents=parents, path_probs=path_probs)

    def release(self, seq_id: Hashable) -> None:
        pass
