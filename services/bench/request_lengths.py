"""How many tokens each request of a bench's load asks for: the same for all, or each its own.

Why vary them: requests of one length that start together end together, and each client's next request then starts
with the others', so that without speculation every decoding step of a batch runs all its rows (lockstep). With
speculation, rows end at different steps, and while a finished row's successor is on its way (its client sends it
as the answer ends) the steps run a row short, and its prefill shares a step with the others' decoding. Served
requests end at their own lengths, speculation or not, so a bench whose lengths are equal favours no speculation:
engine_host_cost at 8 rows of chat text on a simulated H200 step ran plain steps of 7.5 rows with ngram against 8.0
without, and read 0.92-0.94x none where with varied lengths it read 0.97-0.99x (the rate without speculation fell
from about 2,500 tok/s to 2,280: lockstep had flattered it). accelerator_step's chats all ran to --max-tokens (an
H200's 64 chats, 3 requests a client: 390 steps for 3 x 128 tokens without speculation, lockstep) until stop 75."""

from __future__ import annotations

LENGTHS = ("varied", "equal")
SPREAD = 37  # consecutive requests' lengths this many tokens apart, modulo the range (far apart in it)


def request_tokens(index: int, tokens: int, varied: bool) -> int:
    """The tokens request `index` asks for: `tokens`, or, `varied`, from `tokens` (request 0) down to just over half
    of it."""
    return tokens - (index * SPREAD) % max(1, tokens // 2) if varied else tokens


def add_lengths_argument(parser) -> None:
    parser.add_argument("--lengths", choices=LENGTHS, default="varied",
                        help="requests ask for from the tokens given down to just over half of them, each its own "
                             "(request_lengths.py), or each for all of them (the only way before stop 75; it favours "
                             "no speculation)")
