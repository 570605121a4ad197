"""Which target layers a verifier serves (served_hidden_layers.py), and the drafters it refuses for them
(remote_proposer.hidden_states_mismatch): one set per verifier, fixed at start-up."""

from __future__ import annotations

import pytest

from services.common.proposer import ProposerCapabilities
from services.verifier.main import layer_list
from services.verifier.remote_proposer import hidden_states_mismatch
from services.verifier.served_hidden_layers import served_hidden_layers


class Declares:
    def __init__(self, needs: bool, layers: tuple[int, ...] = (-1,)) -> None:
        self.capabilities = ProposerCapabilities(needs_hidden_states=needs, hidden_layers=layers, hidden_size=64)


def test_the_served_layers_are_the_configured_ones_else_the_drafters_else_the_final_one():
    assert served_hidden_layers([]) == (-1,)
    assert served_hidden_layers([Declares(False, (3, 4))]) == (-1,)  # it reads none: its declaration is moot
    assert served_hidden_layers([Declares(True, (2, 5, 9)), Declares(False)]) == (2, 5, 9)
    assert served_hidden_layers([Declares(True, (2, 5, 9)), Declares(True, (2, 5, 9))]) == (2, 5, 9)
    assert served_hidden_layers([Declares(True, (2, 5, 9))], configured=(1, 2)) == (1, 2)
    with pytest.raises(ValueError, match=r"read different target layers \(\[-1\], \[2, 5, 9\]\)"):
        served_hidden_layers([Declares(True, (2, 5, 9)), Declares(True)])


def test_a_drafter_is_refused_for_layers_the_verifier_does_not_serve_or_the_target_lacks():
    eagle3 = Declares(True, (2, 5, 9)).capabilities
    assert hidden_states_mismatch(eagle3, 64, 12, None) is None  # not fixed yet: any layers the target has
    assert hidden_states_mismatch(eagle3, 64, 12, (2, 5, 9)) is None
    assert "this verifier serves layers [-1]" in hidden_states_mismatch(eagle3, 64, 12, (-1,))
    assert "hidden layer 9 does not exist: the target has 6 decoder layers" in hidden_states_mismatch(eagle3, 64, 6)
    assert "width 64, but the target's are 128 wide" in hidden_states_mismatch(eagle3, 128, 12)


def test_the_hidden_layers_flag_takes_a_comma_separated_list():
    assert layer_list("2,15,27") == [2, 15, 27] and layer_list("-1") == [-1]
    with pytest.raises(Exception, match="comma-separated layer numbers"):
        layer_list("2;15")
