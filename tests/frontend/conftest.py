import uuid

import pytest


@pytest.fixture
def model() -> str:
    """A model name of the test's own, so that tests never see each other's workers."""
    return f"org/flow-{uuid.uuid4().hex[:8]}"
