"""EAGLE speculation (`--method eagle --model HEAD_DIR`; without --model, the head that ships for the default
target, services/modeling/eagle_heads/): a one-layer head drafts from the target's own hidden
states, which the verifier sends with the committed tokens (the drafter declares needs_hidden_states).

The head (services/modeling/eagle_head.py) shares the target's embedding and LM head, loaded here from the target
its config names (`target`, a --model spec), so the drafter must run beside a verifier serving that target (the
vocabulary fingerprint check enforces it). Per sequence the head keeps a KV cache over committed positions; a
step feeds the positions committed since the last one, then drafts a chain of K by argmax, feeding back its own
features, from a copy of that cache (drafts never enter it, so nothing needs rolling back). The chains of every
sequence in a step run together, one batched head step per draft position; a head with a reduced draft vocabulary
scores only those rows of the LM head. A new sequence starts from the head cache of its longest cached prefix
(head_prefix_cache.py), so a repeated prompt costs the head no prefill either.

Pipelining (`draft_pipelining`, services/drafter/draft_pipelining.py): after answering a call, the proposer
goes on drafting while the verifier verifies, on the guess that the whole draft d is accepted (a tree's first
path: guessed_path): it runs the chain again with d forced, takes its next argmax as the guessed bonus g and K more after it, for the committed tokens
committed + d + g. Unlike the draft model's, this pre-draft is not the draft a fresh call would give: the head
has no target features for d and g yet and reads its own, as it does inside any chain. It is still a draft of
exactly those committed tokens (answered only when the next call brings them), and the verifier checks it like
any other, so losslessness does not depend on it; whether its lower acceptance pays for the hidden drafting time
is measured (services/bench/draft_pipelining.py). The target features of d and g are fed into the head's cache
with the next pre-draft or call.

Threads: every tensor operation runs on one worker thread, off the event loop (the drafter keeps answering
Info and health checks), as the draft-model drafter does; `release` only queues the id.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from services.common.device import resolve_device, resolve_dtype
from services.common.growing_rows import GrowingRows
from services.common.main_thread_compute import worker_thread
from services.common.proposer import Draft, DraftInput, ProposerCapabilities
from services.common.method_options import DEFAULT_EAGLE_TOPK
from services.common.speculative_config import SpeculativeConfig
from services.common.token_trees import leaf_paths
from services.drafter.draft_pipelining import PreDraft, PreDraftRunner, PreDrafts, wants_predraft
from services.drafter.eagle_catch_up import CatchUpGraphs, catch_up_body
from services.drafter.eagle_head_graphs import ChainInputs, HeadGraphs, draft_chains
from services.drafter.eagle_tree_candidates import tree_candidates, tree_columns
from services.drafter.eagle_trees import TreeStart, padded_caches, sampled_trees, sent_trees, tree_shape
from services.drafter.head_kernels import use_chosen_kernels
from services.drafter.head_prefix_cache import BLOCK, HeadPrefixCache, HeadRows, Publication
from services.modeling.eagle3_head import Eagle3Head
from services.modeling.eagle_head import DraftRows, EagleHead
from services.modeling.eagle_head_files import fit_head_to_target, load_eagle_head
from services.modeling.host_copies import pinned_join, to_device
from services.modeling.step_graphs import power_of_two_at_least
from services.modeling.tokenizer_fingerprint import tokenizer_fingerprint

logger = logging.getLogger(__name__)


@dataclass
class HeadSequence:
    """One sequence's head cache: the K/V of its `fed` committed head positions (position t holds [embed(x_{t+1});
    f_t]), kept as rows [position, kv heads, D] in buffers that double when full (GrowingRows), so feeding a few
    positions copies those, not the whole cache (a cat per call did: on a 2-core CPU, 8 sequences of 2,000
    positions, half the catch-up)."""

    keys: GrowingRows = field(default_factory=GrowingRows)
    values: GrowingRows = field(default_factory=GrowingRows)
    published: tuple[int, int] = (0, 0)  # full blocks given to the prefix cache, and the last one's id

    @property
    def fed(self) -> int:
        return len(self.keys)

    @property
    def cache(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Keys and values [1, kv heads, fed, D] (views, valid while the sequence grows), or None before any."""
        if not len(self.keys):
            return None
        return self.keys.view().permute(1, 0, 2)[None], self.values.view().permute(1, 0, 2)[None]

    @property
    def rows(self) -> HeadRows:
        """Keys and values [fed, kv heads, D] (views, valid while the sequence grows), as the prefix cache takes
        them."""
        return self.keys.view(), self.values.view()

    def restart(self, rows: HeadRows | None = None) -> None:
        """Start over from `rows` (a cached prefix's positions [m, kv heads, D], or none)."""
        self.keys, self.values, self.published = GrowingRows(), GrowingRows(), (0, 0)
        if rows is not None:
            self.keys.append(rows[0])
            self.values.append(rows[1])


@dataclass
class EagleProposer:
    head: EagleHead
    embed: torch.nn.Module
    lm_head: torch.nn.Module | None  # the target's; None for a head that scores with its own (EAGLE-3)
    vocab_size: int
    tokenizer_fingerprint: str = ""
    method: str = "eagle"
    # pre-draft for the sequences whose request does not say (DraftInput.pipelining); off unless configured: its
    # pre-drafts measured slower (draft_pipelining.default_pipelining)
    pipelining: bool = False
    _sequences: dict[Hashable, HeadSequence] = field(default_factory=dict)
    _released: list[Hashable] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _compute: Executor | None = None
    # the LM head rows of the head's draft vocabulary (the target's, or an EAGLE-3 head's own), as it applies them
    draft_rows: DraftRows | None = None
    prefix_cache: HeadPrefixCache = field(default_factory=HeadPrefixCache)
    # token trees (num_draft_tokens set): up to tree_nodes tokens, expanding eagle_topk nodes per depth, at most
    # tree_depth deep (eagle_trees.py); None: chains
    tree_nodes: int | None = None
    tree_topk: int = DEFAULT_EAGLE_TOPK
    tree_depth: int = 5
    # with trees: a sampled request's tree is drawn from the head at its temperature and sent with q, for
    # multi-draft rejection sampling (eagle_trees.sampled_trees; eagle_sampled_trees in the speculative config)
    sampled_trees: bool = False
    _draws: torch.Generator = field(default_factory=torch.Generator)  # the drafter's own, apart from the verifier's
    predrafts: PreDrafts = field(default_factory=PreDrafts)
    predrafting: PreDraftRunner = field(default_factory=PreDraftRunner)
    # on an accelerator, chains and deterministic trees replay captured graphs (eagle_head_graphs.py); None: eager
    chain_graphs: HeadGraphs | None = None
    tree_graphs: HeadGraphs | None = None
    catch_up_graphs: CatchUpGraphs | None = None  # and the catch-up of new positions (eagle_catch_up.py)

    @property
    def capabilities(self) -> ProposerCapabilities:
        """It reads the target's hidden states of the layers and width its head was trained on (the final one for
        EAGLE-1, three for EAGLE-3), drafts from the target's vocabulary, pre-drafts (a request may set
        draft_pipelining), and sends trees where configured."""
        config = self.head.config
        return ProposerCapabilities(
            vocab_size=self.vocab_size, tokenizer_fingerprint=self.tokenizer_fingerprint, needs_hidden_states=True,
            hidden_size=config.target_layer_width, hidden_layers=config.hidden_layers,
            pre_drafts=True, sends_trees=self.tree_nodes is not None)

    @property
    def device(self) -> torch.device:
        """Where the head, the embedding and the LM head run (build_proposer: the speculative config's
        draft_device)."""
        return self.embed.weight.device

    @property
    def state_width(self) -> int:
        """The width of the target states it reads per token: its layers side by side."""
        config = self.head.config
        return config.target_layer_width * len(config.hidden_layers)

    @property
    def pipeline_counts(self):
        """Pre-drafts used and discarded, and the drafting seconds they hid (draft_pipelining.PipelineCounts)."""
        return self.predrafts.counts

    async def propose(self, inputs: Sequence[DraftInput]) -> list[Draft]:
        compute = self._compute_thread()
        wanted = [wants_predraft(item, self.pipelining) for item in inputs]
        # A pre-draft reads its inputs after this call returned, when the caller appends to token_ids: a snapshot.
        inputs = [replace(item, token_ids=tuple(item.token_ids)) if want else item
                  for item, want in zip(inputs, wanted, strict=True)]
        self.predrafting.call_arrived()
        drafts = await asyncio.get_running_loop().run_in_executor(compute, self._draft_all, inputs)
        # a tree's guess is its first path (the head's likeliest chain, as far as the tree kept it) accepted whole
        ahead = [(item, guessed_path(draft)) for item, draft, want in zip(inputs, drafts, wanted, strict=True)
                 if want and draft.token_ids]
        if ahead:
            self.predrafting.start(compute, self._predraft, ahead)
        return drafts

    def _compute_thread(self) -> Executor:
        """The one thread every tensor operation runs on (made at the first need)."""
        if self._compute is None:
            self._compute = worker_thread()
        return self._compute

    def release(self, seq_id: Hashable) -> None:
        with self._lock:
            self._released.append(seq_id)

    @torch.no_grad()
    def _draft_all(self, inputs: list[DraftInput]) -> list[Draft]:
        with self._lock:
            released, self._released = self._released, []
        for seq_id in released:
            self._sequences.pop(seq_id, None)
            self.predrafts.forget(seq_id)
        drafts = [Draft([]) for _ in inputs]
        catching_up = []
        for i, item in enumerate(inputs):
            held = self.predrafts.take(item.seq_id, item.token_ids, item.num_speculative_tokens)
            if held:  # drafted while the verifier verified; its new target features wait for the next pre-draft
                drafts[i] = Draft(list(held))
            else:
                catching_up.append(i)
        starts = self._catch_up([inputs[i] for i in catching_up])
        ready = [(i, row) for i, row in zip(catching_up, starts, strict=True) if row is not None]
        if ready and self.tree_nodes is not None:
            for i, draft in self._trees(inputs, ready):
                drafts[i] = draft
        elif ready:
            chains = self._chains([row for _, row in ready])
            for (i, row), chain in zip(ready, chains, strict=True):
                drafts[i] = Draft(chain[: row.k])
        return drafts

    def _trees(self, inputs: list[DraftInput], ready: list[tuple[int, ChainStart]]) -> list[tuple[int, Draft]]:
        """(input index, its tree): EAGLE-2's deterministic tree, or where sampled_trees is on and the request
        samples, a q-tree drawn at its temperature."""
        drawn = [self.sampled_trees and inputs[i].temperature > 0 for i, _ in ready]
        plain = [entry for entry, d in zip(ready, drawn, strict=True) if not d]
        sampled = [entry for entry, d in zip(ready, drawn, strict=True) if d]
        out = []
        if plain:
            rows = [row for _, row in plain]
            limits = [min(row.k, self.tree_nodes) for row in rows]
            shape = tree_shape(self.tree_topk, self.tree_depth, limits, self._draft_rows().weight.shape[0],
                               bucketed=self.tree_graphs is not None)
            packed = None if self.tree_graphs is None else self.tree_graphs.run(rows, shape)
            if packed is None:
                packed = tree_candidates(self.head, self.embed, self._draft_rows(),
                                         self._padded(rows, tree_columns(*shape)), *shape,
                                         self.vocab_size)
            trees = sent_trees(packed, limits)
            out += [(i, Draft(tree.tokens, parents=tree.parents, path_probs=tree.path_probs))
                    for (i, _), tree in zip(plain, trees, strict=True)]
        if sampled:
            trees = sampled_trees(self.head, self.embed, self._draft_rows(), [row.tree_start() for _, row in sampled],
                                  self.tree_topk, self.tree_depth, [min(row.k, self.tree_nodes) for _, row in sampled],
                                  self.vocab_size, [inputs[i].temperature for i, _ in sampled], self._draws)
            out += [(i, Draft(tree.tokens, tree.probs, tree.parents))
                    for (i, _), tree in zip(sampled, trees, strict=True)]
        return out

    def capture_graphs(self, max_rows: int, max_k: int, max_span: int | None = None) -> int:
        """On an accelerator, capture now, before serving, the drafting graphs of calls of up to `max_rows`
        sequences (eagle_head_graphs.HeadGraphs.capture_ahead): chains of every K up to `max_k` as _chains rounds
        it, or trees of every node limit up to tree_nodes as tree_shape shapes them; and the catch-up of every
        padded number of new positions (eagle_catch_up.py). Returns how many were captured; 0 where drafting
        runs eagerly.

        A tree's ask is for up to tree_nodes tokens (the verifier asks as many as a step affords), whatever the
        depth `max_k` a chain would have: capturing only the limits up to K left the whole tree's shape to be
        captured inside a step that asked for it: on an H200 the EAGLE-3 trees' warm-up met such captures, after
        which the planner asked them for nothing (accelerator_step, stop 65)."""
        if self.tree_nodes is None:
            graphs, parameters = self.chain_graphs, [power_of_two_at_least(k) for k in range(1, max_k + 1)]
        else:
            rows = self._draft_rows().weight.shape[0]
            graphs = self.tree_graphs
            parameters = [tree_shape(self.tree_topk, self.tree_depth, [limit], rows, bucketed=True)
                          for limit in range(1, self.tree_nodes + 1)]
        drafting = 0 if graphs is None else graphs.capture_ahead(max_rows, parameters, max_span)
        return drafting + (0 if self.catch_up_graphs is None else self.catch_up_graphs.capture_ahead())

    @torch.no_grad()
    def warm_up(self, k: int) -> float:
        """Draft twice (a new sequence, then a step on) for a made-up sequence on the compute thread asks run on,
        then forget it; returns the seconds it took. Why: a process's first asks pay one-time costs beyond graph
        captures (on CUDA the compute thread's own cuBLAS handle, the first eager kernels' set-up), and on an H200
        the first asks of both EAGLE drafters missed the verifier's 0.5 s draft deadline, after which the verifier
        asked them only by probes for most of a run. The sequence is shorter than a head prefix-cache block, so
        nothing of it is kept."""
        compute = self._compute_thread()
        tokens = list(range(1, BLOCK))
        states = torch.zeros(len(tokens), self.state_width)
        started = time.perf_counter()
        for n in (len(tokens) - 1, len(tokens)):
            item = DraftInput(WARM_UP_SEQUENCE, tokens[:n], k, states[: n - 1])
            compute.submit(self._draft_all, [item]).result()
        self.release(WARM_UP_SEQUENCE)
        return time.perf_counter() - started

    def _padded(self, rows: Sequence[ChainStart], room: int) -> ChainInputs:
        """What an eager chain or tree reads: the rows' committed caches padded to one length, with `room` columns
        more for the chain's or tree's own K/V, and where each starts."""
        (keys, values), mask = padded_caches(self.head, [(r.cache, ()) for r in rows], room)
        return ChainInputs(keys, values, mask, to_device(torch.tensor([r.token for r in rows]), self.device),
                           torch.stack([r.feature for r in rows]),  # [B, 1, H]
                           to_device(torch.tensor([r.position for r in rows]), self.device))

    def _draft_rows(self) -> DraftRows:
        """The LM head rows of the head's draft vocabulary (taken once; plain unless build_proposer chose)."""
        if self.draft_rows is None:
            self.draft_rows = DraftRows.plain(
                self.head.draft_weight(None if self.lm_head is None else self.lm_head.weight))
        return self.draft_rows

    @torch.no_grad()
    def _predraft(self, ahead: list[tuple[DraftInput, tuple[int, ...]]], stop: Callable[[], bool]) -> None:
        """Draft each sequence's next step on the guess that its draft d (this call's answer) is accepted whole:
        the chain again with d forced, its next argmax as the bonus g, then K more (module docstring). `stop` is
        asked between chain steps: a new call is waiting, so the rest is left to it."""
        started = time.perf_counter()
        starts = self._catch_up([item for item, _ in ahead])  # a no-op unless this call was answered by a pre-draft
        rows = [(item, draft, replace(start, k=len(draft) + 1 + item.num_speculative_tokens))
                for (item, draft), start in zip(ahead, starts, strict=True) if start is not None]
        chains = self._chains([start for *_, start in rows], [draft for _, draft, _ in rows], stop) if rows else None
        if chains is None:
            for _ in rows:
                self.predrafts.stopped()
            return
        seconds = (time.perf_counter() - started) / len(rows)  # each row's share of the batched chain
        for (item, draft, _), chain in zip(rows, chains, strict=True):
            n = len(draft)
            if len(chain) > n + 1:  # else an id past the target's vocabulary cut the chain before it drafted
                base = np.asarray([*item.token_ids, *draft, chain[n]], dtype=np.int64)
                tokens = tuple(chain[n + 1 : n + 1 + item.num_speculative_tokens])
                self.predrafts.keep(item.seq_id, PreDraft(base, tokens, seconds))

    def _catch_up(self, items: Sequence[DraftInput]) -> list[ChainStart | None]:
        """Feed each sequence's newly committed positions into its cache; per item, where its chain starts, or None
        when it cannot draft now (no states yet, or K = 0). Every sequence's new positions go through the head as one
        batch (eagle_catch_up.py: their features and K/V), on an accelerator one captured graph: for 8 sequences of
        4 new positions the shipped head took 19.6 ms a whole head step per sequence on a 2-core CPU and 1.9 ms
        batched, and on a GPU the batch's eager launches were most of an ask's host work."""
        ready = []  # (index, item, its sequence, n, its states from position seq.fed on)
        for i, item in enumerate(items):
            tokens, states = item.token_ids, item.hidden_states
            n = len(tokens) - 1  # the last committed token x_n; states exist for x_0..x_{n-1}
            if states is None or n < 1 or states.shape[0] < n or item.num_speculative_tokens < 1:
                continue
            if states.dim() != 2 or states.shape[1] != self.state_width:  # not the layers it reads: no draft
                continue
            seq = self._sequences.setdefault(item.seq_id, HeadSequence())
            if seq.fed > n - 1:  # the verifier re-sent a shorter sequence: start over
                seq.restart()
            if seq.fed == 0:  # a new sequence: the head cache of its longest cached prefix (head_prefix_cache.py)
                seq.restart(self.prefix_cache.longest(tokens, n - 1)[1])
            # only the rows not fed yet move and convert: the whole history each call grew with the context
            ready.append((i, item, seq, n, states[seq.fed : n]))
        starts: list[ChainStart | None] = [None] * len(items)
        if not ready:
            return starts
        # position t (fed .. n - 1 of each) holds [embed(x_{t+1}); f_t]; the last one's K/V are not kept (a chain
        # computes them as its first step)
        ids = torch.from_numpy(np.concatenate([np.asarray(item.token_ids[seq.fed + 1 : n + 1], dtype=np.int64)
                                               for _, item, seq, n, _ in ready]))
        positions = torch.from_numpy(np.concatenate([np.arange(seq.fed, n) for _, _, seq, n, _ in ready]))
        features, keys, values = self._new_positions(ids, [unfed for *_, unfed in ready], positions)
        counts = [len(unfed) for *_, unfed in ready]
        ends = np.cumsum(counts) - 1
        last = features[torch.from_numpy(ends).to(features.device)]  # [rows, H]: each chain's first feature
        # commit positions fed..n-2 of each: copied into its buffers (no view of the batch kept), every sequence's
        # in one grouped copy (on CUDA one kernel where they were two launches a sequence)
        into, new_rows, committed = [], [], []
        for (_, item, seq, n, _), k, v in zip(ready, keys.split(counts), values.split(counts), strict=True):
            if seq.fed < n - 1:
                for buffer, rows in ((seq.keys, k[:-1]), (seq.values, v[:-1])):
                    into.append(buffer.extend(len(rows), rows))
                    new_rows.append(rows)
                committed.append((item, seq))
        if into:
            torch._foreach_copy_(into, new_rows)
        published = self.prefix_cache.publish([Publication(item.token_ids, seq.rows, seq.fed, seq.published)
                                                for item, seq in committed])
        for (_, seq), progress in zip(committed, published, strict=True):
            seq.published = progress
        for row, (i, item, seq, n, _) in enumerate(ready):
            starts[i] = ChainStart(seq.cache, n - 1, int(item.token_ids[n]), last[row : row + 1],
                                   item.num_speculative_tokens)
        return starts

    def _new_positions(self, ids: torch.Tensor, states: list[torch.Tensor], positions: torch.Tensor):
        """The head's features [N, H] and K/V [N, kv heads, D] of new positions (token ids and positions [N] on
        the host; each sequence's states, on the host or the device): a captured graph's where there is one for
        this many, else eagerly, end to end on the head's device in its dtype, from the host without waiting
        (pinned), as the verifier's inputs."""
        def moved(rows: torch.Tensor) -> torch.Tensor:
            return rows if rows.device == self.device else to_device(rows, self.device)

        on_host = all(rows.device.type == "cpu" for rows in states)
        if on_host and self.device.type == "cuda":  # joined once, into pinned memory, which a copy reads at once
            joined = pinned_join(states)
        elif on_host or all(rows.device == states[0].device for rows in states):
            joined = torch.cat(states)
        else:
            joined = torch.cat([moved(rows) for rows in states])
        if self.catch_up_graphs is not None:
            replayed = self.catch_up_graphs.run(ids, joined, positions)
            if replayed is not None:
                return replayed
        body = catch_up_body(self.head, self.embed)
        return body(to_device(ids, self.device), moved(joined).to(self.embed.weight.dtype),
                    to_device(positions, self.device))

    def _chains(self, rows: list[ChainStart], forced: list[tuple[int, ...]] | None = None,
                stop: Callable[[], bool] | None = None) -> list[list[int]] | None:
        """Argmax chains for every row at once: their caches padded to one length (a mask hides the padding),
        one batched head step per draft position, from copies (drafts never enter a sequence's own cache);
        on an accelerator one captured graph replays them all (eagle_chain_graphs.py). `forced[b]`: tokens row
        b's chain takes instead of its argmax at its first steps (a pre-draft's answered draft). None when
        `stop()` said so between steps. The tokens stay on the head's device until the chain is done: one host
        sync per call, where reading each step's argmax made an accelerator wait K times."""
        k = max(r.k for r in rows)
        drafted = None
        if forced is None and self.chain_graphs is not None:
            drafted = self.chain_graphs.run(rows, power_of_two_at_least(k))  # drafts more, cut below: few graphs
        if drafted is None:
            forcing = _forced_tokens(forced, self.device) if forced is not None and any(forced) else None
            drafted = draft_chains(self.head, self.embed, self._draft_rows(), self._padded(rows, k), k, forcing, stop)
            if drafted is None:
                return None
        by_row = drafted[:, :k].tolist()
        return [row[: next((i for i, t in enumerate(row) if t >= self.vocab_size), len(row))] for row in by_row]


WARM_UP_SEQUENCE = object()  # warm_up's sequence: an id no request has


def _forced_tokens(forced: list[tuple[int, ...]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's forced tokens, padded to the longest ([B, F] int64), and where a row has one ([B, F] bool)."""
    width = max(map(len, forced))
    ids = torch.tensor([list(f) + [0] * (width - len(f)) for f in forced], dtype=torch.int64)
    where = torch.tensor([[j < len(f) for j in range(width)] for f in forced])
    return to_device(ids, device), to_device(where, device)


@dataclass
class ChainStart:
    """Where one sequence's draft chain starts: its committed cache, the head position of its last committed
    token x_n (n - 1), that token, the head's feature of the target's state after x_{n-1} [1, H]
    (EagleHead.target_features), and the K wanted."""

    cache: tuple[torch.Tensor, torch.Tensor] | None
    position: int
    token: int
    feature: torch.Tensor
    k: int

    def tree_start(self) -> TreeStart:
        return TreeStart(self.cache, self.position, self.token, self.feature)


def guessed_path(draft: Draft) -> tuple[int, ...]:
    """What a pre-draft guesses is accepted: a chain whole, a tree's first root-to-leaf path (its tokens in order are
    no path at all)."""
    if draft.parents is None:
        return tuple(draft.token_ids)
    return tuple(draft.token_ids[i] for i in leaf_paths(draft.parents)[0])


def build_proposer(config: SpeculativeConfig) -> EagleProposer:
    """The registry's entry point: the head and the target's vocabulary weights (load_proposer), on CPU through the
    kernels a draft step measured fastest, on an accelerator with its drafting captured as graphs (before serving,
    for up to draft_max_num_seqs sequences; none with enforce_eager); then its first asks drafted (warm_up)."""
    proposer = load_proposer(config)
    head, embed = proposer.head, proposer.embed
    if proposer.device.type == "cpu":  # the head's matmuls through the kernels measured fastest here (head_kernels.py)
        proposer.draft_rows = use_chosen_kernels(head, proposer._draft_rows())
    else:  # fewer launches a draft step
        head.fuse_sibling_linears()
    shape = (head.config.num_key_value_heads, head.config.head_dim, head.config.hidden_size, embed.weight.dtype,
             proposer.device)
    if not config.enforce_eager:
        proposer.chain_graphs = HeadGraphs.for_device(
            lambda inputs, k: draft_chains(head, embed, proposer._draft_rows(), inputs, k), *shape)
        proposer.tree_graphs = HeadGraphs.for_device(
            lambda inputs, tree: tree_candidates(head, embed, proposer._draft_rows(), inputs, *tree,
                                                 proposer.vocab_size), *shape)
        proposer.catch_up_graphs = CatchUpGraphs.for_device(catch_up_body(head, embed), proposer.state_width,
                                                            embed.weight.dtype, proposer.device)
    with torch.no_grad():
        proposer.capture_graphs(config.draft_max_num_seqs, config.num_speculative_tokens, config.max_model_len)
    seconds = proposer.warm_up(proposer.tree_nodes or config.num_speculative_tokens)
    logger.info("first asks drafted in %.2f s (warm-up)", seconds)
    return proposer


def load_proposer(config: SpeculativeConfig) -> EagleProposer:
    """The head of `config` (or the one that ships for its target) with the target's embedding and LM head, placed
    and typed as the config says, its linears the plain modules."""
    from services.modeling.eagle_heads import shipped_head
    from services.modeling.vocabulary_weights import load_vocabulary_weights

    options = config.options  # EagleOptions (services/common/method_options.py)
    method = "eagle3" if config.method == "eagle3" else "eagle"
    head_dir = Path(config.model).expanduser() if config.model else shipped_head(method=method)
    head = load_eagle_head(head_dir)  # any layout users have (eagle_head_files.py); a clear error otherwise
    kind = "eagle3" if isinstance(head, Eagle3Head) else "eagle"
    if config.method in ("eagle", "eagle3") and kind != config.method:
        raise ValueError(f"the head at {head_dir} is {'an EAGLE-3' if kind == 'eagle3' else 'an EAGLE-1'} head: "
                         f"use method {kind!r}")
    target_spec = options.target_model or head.config.target
    if not target_spec:
        raise ValueError(f"the EAGLE head at {head_dir} names no target model to share the embedding with: set "
                         "target_model in the speculative config to the verifier's --model")
    # draft_device / draft_dtype: where the head runs (serve --device/--dtype set them, launcher.py); auto: the
    # accelerator when there is one, in its half precision, else the CPU in float32
    device = resolve_device(config.draft_device)
    dtype = resolve_dtype(config.draft_dtype, device)
    # the rest of the target is not read; an EAGLE-3 head scores with its own LM head, and may ship its own embedding
    target = load_vocabulary_weights(target_spec, device=device, dtype=dtype,
                                     embedding=getattr(head, "embed_tokens", None) is None, lm_head=kind == "eagle")
    fit_head_to_target(head, target.config, head_dir)
    head.to(device=device, dtype=dtype)
    embed = head.token_embedding(target.embedding)
    lm_head = target.lm_head
    logger.info("%s head %s for %s (hidden %d, target layers %s) on %s in %s", type(head).__name__, head_dir,
                target_spec, head.config.hidden_size, list(head.config.hidden_layers), device, dtype)
    return EagleProposer(head, embed, lm_head, int(target.config.vocab_size),
                         tokenizer_fingerprint(target.tokenizer), method=kind,
                         pipelining=bool(config.draft_pipelining), tree_nodes=options.num_draft_tokens,
                         tree_topk=options.tree_topk, tree_depth=config.num_speculative_tokens,
                         sampled_trees=options.eagle_sampled_trees)
