"""Whose a request is, as far as what the head keeps between requests is concerned.

A ``Tenant`` is a field of every internal request (``GenerationRequest.tenant``),
set where a protocol builds it: the identity of the API key the request came with
(``keys.Caller``, which the ``ApiKey`` middleware found; b"" on a server without
keys) and the request's own ``cache_salt``. ``Tenant.salt`` is the salt of the
request's prefix-cache keys (``core/prefix_index.chain_hashes``): requests with
different salts never share a cached block, so ``cached_tokens`` (and a reply's
speed) tells one tenant nothing about another's prompts. Without a key and without
a ``cache_salt`` the salt is empty: one cache for everyone, as for one user. Stored
responses belong to the key (``Tenant.key``), whatever salt they were made with.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Tenant:
    key: bytes = b""                  # the API key's identity (``keys.Caller.identity``; b"": no keys)
    cache_salt: Optional[str] = None  # the request's ``cache_salt`` (vLLM's field): a tenant inside the key

    def salt(self) -> bytes:
        """The prefix-cache salt: the key's, with the request's ``cache_salt``; empty for neither."""
        if not self.key and not self.cache_salt:
            return b""
        data = self.key + b"\x00" + (self.cache_salt or "").encode()
        return hashlib.blake2b(data, digest_size=16, person=b"mlxpipe-salt").digest()
