"""API keys: the ``Authorization`` values that pass, and what a refused client is told."""

from __future__ import annotations

from pdserve.frontend.auth import ApiKeys


def test_only_a_bearer_of_a_configured_key_passes():
    keys = ApiKeys(["sk-one", "sk-two"])
    assert keys.required
    assert keys.allows("Bearer sk-one") and keys.allows("bearer sk-two") and keys.allows("  Bearer   sk-two ")
    for refused in (None, "", "sk-one", "Bearer", "Bearer sk-on", "Bearer sk-one2", "Basic sk-one", "Bearer é"):
        assert not keys.allows(refused), refused


def test_without_keys_everything_passes_and_messages_never_hold_the_key():
    assert ApiKeys([]).allows(None) and not ApiKeys([]).required
    assert "sk-secret" not in ApiKeys.problem("Bearer sk-secret") and "Authorization" in ApiKeys.problem(None)
