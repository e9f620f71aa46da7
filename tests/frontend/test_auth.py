"""API keys: the ``Authorization`` values that pass, and what a refused client is told."""

from __future__ import annotations

from pdserve.frontend.auth import ApiKeys


def test_only_a_bearer_of_a_configured_key_passes():
    keys = ApiKeys(["sk-one", "sk-two"])
    assert keys.required
    assert keys.allows("Bearer sk-one") and keys.allows("bearer sk-two") and keys.allows("  Bearer   sk-two ")
    for refused in (None, "", "sk-one", "Bearer", "Bearer sk-on", "Bearer sk-one2", "Basic sk-one", "Bearer é"):
        assert not keys.allows(refused), refused


def test_every_spelling_of_a_key_is_the_same_client_and_no_key_is_one_shared_client():
    """The rate limiter's buckets: one per key however the header spells it, never the key itself."""
    keys = ApiKeys(["sk-one", "sk-two"])
    assert keys.identify("Bearer sk-one") == keys.identify("bearer sk-one") == keys.identify("  Bearer   sk-one ")
    assert keys.identify("Bearer sk-one") != keys.identify("Bearer sk-two")
    assert "sk-" not in keys.identify("Bearer sk-two") and keys.identify("Bearer sk-three") is None
    assert ApiKeys([]).identify(None) == ApiKeys([]).identify("Bearer anything") == ""


def test_without_keys_everything_passes_and_messages_never_hold_the_key():
    assert ApiKeys([]).allows(None) and not ApiKeys([]).required
    assert "sk-secret" not in ApiKeys.problem("Bearer sk-secret") and "Authorization" in ApiKeys.problem(None)
