"""The OpenAI-compatible HTTP gateway: HTTP, tokenization, chat templates, detokenization and stop strings.

It talks to the verifier only through the gRPC contract in proto/specserve/v1/verifier.proto and never imports
the verifier or drafter packages, so it can be deployed and scaled on its own.
"""
