"""Which prefix-cache salt a request runs under: the one it sent, its API key's, or both.

A request may name a ``cache_salt`` (``GenerateRequest.cache_salt``, the OpenAI body's
``cache_salt``); the engine and the router then share its prompt's cached blocks only with
requests of the same salt (``types.cache_salt``). With ``--cache-salt-from-key`` every key also
has a salt of its own, ``key_salt``: a keyed hash (HMAC-SHA256 keyed with the API key) of a
fixed label, so it names the key without revealing it, is the same on every frontend given the
key, and does not change when other keys are added or removed. The rule (``combine``):

- no key salt: the request's salt, if any;
- a key salt: the key's salt, followed by the request's after a ``/`` when it sent one.

A tenant's salt therefore always starts with its own key's, and no request can pick a salt
that another key's requests run under: tenants are isolated without any change to clients, and
a tenant may still split its own cache further.
"""

from __future__ import annotations

import hashlib
import hmac

_LABEL = b"pdserve cache salt v1"


def key_salt(key: str) -> str:
    """The salt of an API key's requests (32 hex digits); never the key, nor a way back to it."""
    return hmac.new(key.encode(errors="surrogateescape"), _LABEL, hashlib.sha256).hexdigest()[:32]


def combine(key_salt: str | None, requested: str | None) -> str | None:
    """The salt a request runs under, from its key's (None: salts are not derived from keys)
    and the one it sent (None or empty: none)."""
    if key_salt is None:
        return requested or None
    return f"{key_salt}/{requested}" if requested else key_salt
