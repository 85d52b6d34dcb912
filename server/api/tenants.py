"""Who is asking, as far as the prefix cache is concerned.

A server may accept several API keys (``--api-key-file``, one a line: one per
user or app). Each key is a tenant: the ``ApiKey`` middleware finds which key a
request presents and sets it for the request (a context variable, as
``request_log`` does), and ``salt`` turns it, with the request's own
``cache_salt``, into the salt of the request's prefix-cache keys
(``core/prefix_index.chain_hashes``). Requests with different salts never
share a cached block, so ``cached_tokens`` (and a reply's speed) tells one
tenant nothing about another's prompts. Without keys and without a
``cache_salt`` the salt is empty: one cache for everyone, as before.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
from contextvars import ContextVar
from typing import Iterator, Mapping, Optional, Sequence

_tenant: ContextVar[bytes] = ContextVar("mlxpipe_tenant", default=b"")


def _digest(data: bytes, person: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16, person=person).digest()


class Keys:
    """The API keys a server accepts, each a tenant (known by a digest of its key,
    so the key itself is never kept beside the cache)."""

    def __init__(self, keys: Sequence[str]):
        self.bearers = [f"Bearer {k}".encode() for k in keys]
        self.keys = [k.encode() for k in keys]
        self.tenants = [_digest(k, b"mlxpipe-tenant") for k in self.keys]

    def tenant(self, headers: Mapping[bytes, bytes]) -> Optional[bytes]:
        """The tenant whose key the headers present (``Authorization: Bearer <key>`` or
        ``x-api-key: <key>``), or None. Every key is compared, in constant time each."""
        auth, key = headers.get(b"authorization", b""), headers.get(b"x-api-key", b"")
        found = None
        for bearer, mine, tenant in zip(self.bearers, self.keys, self.tenants):
            if hmac.compare_digest(auth, bearer) | hmac.compare_digest(key, mine):
                found = tenant
        return found


@contextlib.contextmanager
def serving(tenant: bytes) -> Iterator[None]:
    """The request being served is ``tenant``'s."""
    token = _tenant.set(tenant)
    try:
        yield
    finally:
        _tenant.reset(token)


def salt(cache_salt: Optional[str]) -> bytes:
    """The prefix-cache salt of the request being served: its tenant's, with its own
    ``cache_salt``; empty for neither."""
    tenant = _tenant.get()
    if not tenant and not cache_salt:
        return b""
    return _digest(tenant + b"\x00" + (cache_salt or "").encode(), b"mlxpipe-salt")
