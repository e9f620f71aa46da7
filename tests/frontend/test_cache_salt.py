"""The salt a request runs under: its own, its key's, or its key's followed by its own — never
another key's, whatever it sends."""

from __future__ import annotations

import pytest

from pdserve.frontend.auth import ApiKeys
from pdserve.frontend.cache_salt import combine, key_salt
from pdserve.frontend.config import FrontendConfig

KEYS = ["sk-tenant-a-0123456789", "sk-tenant-b-9876543210"]


def test_each_key_has_a_stable_salt_that_does_not_show_the_key():
    a, b = (key_salt(key) for key in KEYS)
    assert a != b and len(a) == 32 and a == key_salt(KEYS[0])
    assert all(key not in salt and salt not in key for key, salt in zip(KEYS, (a, b)))
    keys = ApiKeys(KEYS, salt_from_key=True)
    assert keys.cache_salt(keys.identify(f"Bearer {KEYS[1]}")) == b
    # The same salt whatever the key's position: adding or removing keys moves no tenant.
    assert ApiKeys(KEYS[::-1], salt_from_key=True).cache_salt("key-0") == b
    assert ApiKeys(KEYS).cache_salt(keys.identify(f"Bearer {KEYS[1]}")) is None  # not asked for: no salt
    assert keys.cache_salt(None) is None


def test_a_requests_salt_extends_its_keys_and_never_replaces_it():
    a, b = (key_salt(key) for key in KEYS)
    assert combine(None, "") is None and combine(None, "x") == "x"
    assert combine(a, "") == a and combine(a, None) == a and combine(a, "x") == f"{a}/x"
    # Tenant b naming a's salt, or anything built from it, still runs under its own.
    for chosen in (a, f"{a}/x", "", "x"):
        assert combine(b, chosen).startswith(f"{b}") and combine(b, chosen) not in {a, f"{a}/x", combine(a, chosen)}


def test_salts_from_keys_need_keys():
    with pytest.raises(ValueError, match="cache_salt_from_key needs api_keys"):
        FrontendConfig(etcd="http://127.0.0.1:2379", cache_salt_from_key=True)
    FrontendConfig(etcd="http://127.0.0.1:2379", api_keys=KEYS, cache_salt_from_key=True)
