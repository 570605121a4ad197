"""How likely each draft position is to be accepted: per request and per position, learned online.

Drafts are accepted as a run: position j counts only if positions 1..j-1 were accepted. So the quantity that is
learned is the *conditional* acceptance of position j given the positions before it, and the probability that
position j contributes a token is the product of the conditionals up to j (`survival`).

Each observation of a verified draft of d tokens with a accepted says: positions 1..a were accepted given their
predecessors, position a+1 was rejected (when a < d), positions after that tell nothing. A row whose proposer
had no draft teaches nothing either: the planner sees which rows have drafts before it chooses what to verify,
so the estimate it needs is acceptance given that a draft exists.

Two levels, because a new request has no history: every method keeps slowly forgetting counts over all its
requests (the prior), and each request keeps quickly forgetting counts of its own, pulled toward the method's
figure by a few pseudo-observations. A request's acceptance changes within one answer (copying a quoted block,
then writing new text), hence the fast forgetting.
"""

from __future__ import annotations

from dataclasses import dataclass, field

INITIAL_ACCEPTANCE = 0.6  # what a method is assumed to achieve before its first verified draft
INITIAL_WEIGHT = 2.0  # ... worth this many observations
REQUEST_DECAY = 0.8  # a request's counts halve in about three verified drafts
METHOD_DECAY = 0.98  # a method's counts halve in about 35 verified drafts (over all its requests: a few steps of a batch)
PRIOR_WEIGHT = 2.0  # pseudo-observations of the method's figure in each request's estimate
DRAFT_RATE_SMOOTHING = 0.2  # weight of the newest ask in a request's rate of asks answered with a draft
PRIOR_TOLERANCE = 0.02  # a method's position-1 rate may move this much before its rows are worked out again


def shrunk(accepted: float, observed: float, prior: float, prior_weight: float) -> float:
    """An acceptance rate from counts, shrunk toward `prior` by `prior_weight` pseudo-observations."""
    return (accepted + prior * prior_weight) / (observed + prior_weight)


RESCALE_BELOW = 1e-30  # PositionCounts folds its running scale into the counts once it falls below this


@dataclass
class PositionCounts:
    """Exponentially forgotten accept/observe counts per draft position (index 0 is position 1).

    Forgetting is lazy: the counts are held divided by a running `_scale` (the decay to the power of the
    observations so far), so an observation multiplies one number and adds 1 / scale to the positions it judged,
    instead of decaying every position's two counts: a row's observation (its counts and its method's) took 2.2 ->
    2.0 us at 4 positions, 2.8 -> 2.0 at 8 and 3.8 -> 2.1 at 16 (a tree's; 2-core EPYC). Once the scale falls below
    RESCALE_BELOW it is folded into the counts, long before the held values could lose precision (they stay within
    a factor 1e30 of the counts they stand for)."""

    decay: float
    _accepted: list[float] = field(default_factory=list)  # each position's count divided by _scale
    _observed: list[float] = field(default_factory=list)
    _scale: float = 1.0
    version: int = 0  # observations so far that changed the counts (what a cached estimate was computed at)

    @property
    def accepted(self) -> list[float]:
        return [count * self._scale for count in self._accepted]

    @property
    def observed(self) -> list[float]:
        return [count * self._scale for count in self._observed]

    def observe(self, num_draft: int, num_accepted: int) -> None:
        """A verified draft of `num_draft` tokens of which the first `num_accepted` were accepted."""
        seen = min(num_accepted + 1, num_draft)  # the accepted run and the first rejection
        if seen <= 0:
            return
        self.version += 1
        missing = seen - len(self._observed)
        if missing > 0:
            self._accepted += [0.0] * missing
            self._observed += [0.0] * missing
        self._scale *= self.decay
        if self._scale < RESCALE_BELOW:
            self._accepted = self.accepted
            self._observed = self.observed
            self._scale = 1.0
        one = 1.0 / self._scale  # a count of 1 as held
        accepted, observed = self._accepted, self._observed
        for j in range(seen):
            observed[j] += one
        for j in range(min(num_accepted, seen)):
            accepted[j] += one

    def at(self, position: int) -> tuple[float, float]:
        """The (accepted, observed) counts of `position` (1-based); 0 where never observed."""
        j = position - 1
        if j < len(self._observed):
            return self._accepted[j] * self._scale, self._observed[j] * self._scale
        return 0.0, 0.0

    def rate(self, position: int, prior: float, prior_weight: float) -> float:
        """Conditional acceptance of `position` (1-based), shrunk toward `prior` by `prior_weight` observations."""
        return shrunk(*self.at(position), prior, prior_weight)


@dataclass
class MethodAcceptance:
    """One drafter method's acceptance over all its requests: the prior of each new request's estimate.

    Every verified draft of any of its requests moves it, and every request's estimate leans on it, so each of those
    drafts had every request's estimate worked out again: about 0.6 ms at 64 rows, after about one plan in five
    (engine_host_cost's chat text on a simulated H200 step, 2-core EPYC). So the estimates follow its `epoch`
    instead, which moves once its position-1 rate has moved by more than PRIOR_TOLERANCE since the epoch began: at
    most that much on a request's first position, where a plan's choice turns on far larger differences (a column
    costs what a fifth of the rows' tokens are worth at 64 rows on an accelerator). A request's own verified drafts
    still have its estimate worked out again at once, with the prior as it is then."""

    counts: PositionCounts = field(default_factory=lambda: PositionCounts(METHOD_DECAY))
    epoch: int = 0
    _epoch_rate: float = INITIAL_ACCEPTANCE  # the position-1 rate when the epoch began

    def first_position_rate(self, own: OwnShare | None = None) -> float:
        """Acceptance of position 1 over the method's requests, from INITIAL_ACCEPTANCE before any draft (the
        prior of a request's position 1; deeper positions follow the request's own estimates, see survival).
        `own`: leave out what one request contributed (its estimate's prior is the others' record)."""
        accepted, observed = self.counts.at(1)
        if own is not None:
            own_accepted, own_observed = own.now(self.counts)
            accepted, observed = max(0.0, accepted - own_accepted), max(0.0, observed - own_observed)
        return shrunk(accepted, observed, INITIAL_ACCEPTANCE, INITIAL_WEIGHT)

    def observe(self, num_draft: int, num_accepted: int) -> None:
        self.counts.observe(num_draft, num_accepted)
        rate = self.first_position_rate()
        if abs(rate - self._epoch_rate) > PRIOR_TOLERANCE:
            self.epoch += 1
            self._epoch_rate = rate


@dataclass
class OwnShare:
    """What one request's drafts put into its method's position-1 counts, as of the method's counts at `version`
    (the method forgets it as it forgets the rest: by its decay for each observation since)."""

    accepted: float = 0.0
    observed: float = 0.0
    version: int = 0

    def now(self, method: PositionCounts) -> tuple[float, float]:
        """The share (accepted, observed) as `method` holds it now, faded by its observations since."""
        fade = method.decay ** (method.version - self.version)
        return self.accepted * fade, self.observed * fade

    def add(self, method: PositionCounts, accepted: bool) -> None:
        """After `method` counted this request's draft at position 1."""
        faded_accepted, faded_observed = self.now(method)
        self.accepted, self.observed = faded_accepted + float(accepted), faded_observed + 1.0
        self.version = method.version


@dataclass
class DraftRate:
    """How often a request's proposer answers an ask with a draft at all: an n-gram or suffix drafter proposes
    only where its history matches, so on new text most asks come back empty. The planner weighs a row's
    expected gain by it before asking, so it does not ask every row for a full draft only to verify none."""

    # Optimistic: a new request is asked, and learns its own rate. The first plan then weighs never-asked rows as if
    # their drafter always had a draft (at 64 rows of chat it expected a draft for 84% of the rows it asked, and 60%
    # had one), but that is what finds the requests worth asking among new ones. Started from its method's rate
    # instead (stop 77, tried and reverted), a code edit among 64 chats was never asked: its latency went from
    # 619-836 ms to 1,170-1,284 ms, no speculation's 1,221-1,225 (engine_host_cost --text mixed, ngram, simulated
    # H200 step, two runs each), and one chat alone went from 0.99-1.02x to 0.96-0.98x none.
    rate: float = 1.0

    def observe(self, answered: bool) -> None:
        self.rate += DRAFT_RATE_SMOOTHING * (float(answered) - self.rate)


@dataclass
class AcceptanceEstimate:
    """One request's acceptance per draft position, starting from its method's and learning its own."""

    method: MethodAcceptance
    counts: PositionCounts = field(default_factory=lambda: PositionCounts(REQUEST_DECAY))
    own: OwnShare = field(default_factory=OwnShare)  # this request's part of the method's counts
    # (version of this request's counts, the method's epoch) -> survival, as computed last (its longest read)
    _cached: tuple[tuple[int, int], tuple[float, ...]] | None = field(default=None, repr=False, compare=False)

    def observe(self, num_draft: int, num_accepted: int) -> None:
        """Record a verified draft here and in the method's prior."""
        self.counts.observe(num_draft, num_accepted)
        self.method.observe(num_draft, num_accepted)
        if num_draft > 0:
            self.own.add(self.method.counts, num_accepted > 0)

    def survival(self, num_positions: int) -> tuple[float, ...]:
        """P(position j's token is accepted) for j = 1..num_positions: the product of the conditionals.

        Position 1 is pulled toward the method's figure over its other requests: this request's drafts are in the
        method's counts too, and counted twice they weighed as if seen twice. Alone on its drafter, a request whose
        first draft was rejected fell from 0.6 to 0.27 at position 1, and so at every position after it (0.4
        counted once), and with the asks priced at a third of a step it never asked again (eagle-sim at 1
        request). Every later position is pulled toward this request's own estimate of the position before it.
        Requests differ far more from each other than positions of one draft do: a request that copies (code edit)
        is accepted deep into its drafts while another of the same method (new code) is not, and the method's
        figure for a deep position would hold the first back until it had been verified that deep, which a narrow
        schedule never does.

        Computed again only when this request's counts changed or its method's epoch moved (MethodAcceptance): the
        planner reads every row's survival twice a step, about 2.5 us a row on a 2-core EPYC, and in steps that
        verify nothing (most, on new text under load) nothing changes. A position's survival does not depend on
        how many are read, so a shorter read is a prefix of the cached one: the first plan reads each row at its
        cap and the second at its draft's length, and a cache of one length missed every other read (402 of
        1,308 misses at 8 rows, ngram). A tuple, so the cached figures are handed out without a copy (or as a
        slice) and no caller can alter them."""
        key = (self.counts.version, self.method.epoch)
        cached = self._cached
        if cached is not None and cached[0] == key and len(cached[1]) >= num_positions:
            return cached[1] if len(cached[1]) == num_positions else cached[1][:num_positions]
        out, running = [], 1.0
        prior = self.method.first_position_rate(self.own)
        for position in range(1, num_positions + 1):
            prior = self.counts.rate(position, prior, PRIOR_WEIGHT)
            running *= prior
            out.append(running)
        self._cached = (key, tuple(out))
        return self._cached[1]
