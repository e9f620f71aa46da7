"""Fixtures of the CLI tests."""

from __future__ import annotations

import uuid

import pytest


@pytest.fixture
def model() -> str:
    """A model name of the test's own (with a slash, as Hugging Face names have) in the shared etcd."""
    return f"org/cli-{uuid.uuid4().hex[:8]}"
