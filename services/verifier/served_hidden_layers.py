"""Which target layers the verifier serves to the drafters that read its hidden states (EAGLE), fixed at start-up.

One runner computes one set per forward (services/modeling/hidden_layers.py), and the prefix cache keeps that set
beside each block's K/V, so the set cannot change while the verifier serves: it is `--hidden-layers` when given,
else what the drafters that read hidden states and were reached at start-up declare (they must agree), else the
final normed layer, all EAGLE-1 reads. A drafter reached later that declares another set is refused with a
message saying so (remote_proposer.hidden_states_mismatch).
"""

from __future__ import annotations

from collections.abc import Iterable

from services.common.proposer import capabilities_of
from services.modeling.hidden_layers import FINAL_ONLY


def served_hidden_layers(proposers: Iterable[object], configured: tuple[int, ...] | None = None) -> tuple[int, ...]:
    if configured is not None:
        return tuple(configured)
    declared = {tuple(capabilities_of(p).hidden_layers) for p in proposers if capabilities_of(p).needs_hidden_states}
    if len(declared) > 1:
        raise ValueError(f"the drafters read different target layers ({', '.join(str(list(d)) for d in sorted(declared))});"
                         " one verifier serves one set: attach drafters that agree, or set --hidden-layers")
    return declared.pop() if declared else FINAL_ONLY
