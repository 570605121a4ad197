"""Shared fixtures. The real model (SmolLM2-135M-Instruct) is fetched once into the user cache and loaded once
per test session."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def smollm2():
    from services.modeling.loading import load_model

    return load_model("smollm2-135m-instruct", device="cpu", dtype="float32")
