"""What the Verifier's calls carry beside the proto's messages, shared by the verifier (which sends it) and the
gateway (which reads it): services never import each other.

GenerateMany's initial metadata names the verifier process serving the call (VERIFIER_ID_KEY, verifier.proto), so
that a gateway keeping one call per verifier (services/gateway/shared_stream_pool.py) can tell when two of its
calls reached the same verifier and make another.
"""

VERIFIER_ID_KEY = "specserve-verifier-id"
