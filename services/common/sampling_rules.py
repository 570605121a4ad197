"""Sampling rules the gateway and the verifier must apply alike (vLLM's conventions), in one place.

The verifier is a public gRPC API of its own, so it enforces these itself; the gateway applies them before
sending so that what it validates, documents and returns agrees with what the engine does.
"""

# Temperatures below this sample greedily (vLLM's _SAMPLING_EPS): dividing logits by 1e-45 overflows to inf and
# turns the distribution into NaNs, while the limit of tempered sampling as T -> 0 is the argmax anyway.
GREEDY_TEMPERATURE_EPS = 1e-5

# Tokens that top-k/top-p/min-p remove have log probability -inf, which JSON cannot carry (and null would read
# as "absent"); like vLLM, such logprobs are reported as this finite floor.
LOGPROB_FLOOR = -9999.0

# Seeds of the signed and the unsigned 64-bit range are accepted (OpenAI, vLLM); both sides keep a seed's 64-bit
# pattern (the wire carries uint64, the engine int64).
SEED_MIN = -(2**63)
SEED_MAX = 2**64 - 1

# bad_words are matched against each verified position's preceding output on the verifier's host, every step:
# bounded in number (token sequences: a word can be two, as written and as a word start) and in tokens each.
MAX_BAD_WORD_SEQUENCES = 128
MAX_BAD_WORD_TOKENS = 32
