"""Who is asking: the API keys a server accepts, what each may do (``KeyPolicy``), and
the ``Caller`` each HTTP request is served as.

The key file (``--api-key-file``) holds one key a line, followed by the key's
fields: ``KEY [field=value ...]`` (blank lines and lines starting with # left
out). A field is one of ``KeyPolicy``'s: ``role`` (``user``, the default, or
``operator``: an operator's /health and /metrics show every key's activity, a
user's only its own), and the key's limits, which ``quotas.py`` enforces:
``rpm`` (requests per minute), ``tpm`` (tokens per minute, prompt and
generated), ``concurrency`` (requests at once), ``max_tokens`` (the longest
reply a request may ask for), ``priority`` (``interactive``, the default, or
``batch``: ``core/priority.py``) and ``models`` (the served models it may use,
comma-separated; default: all). ``$MLXPIPE_API_KEY`` is an operator's key;
a server without keys serves one user, ``LOCAL``, an operator (as ``mlxpipe
generate`` is).

The ``ApiKey`` middleware (``middleware.py``) finds the caller of every request
(``Keys.caller``) and leaves it on the ASGI scope; a route reads it there
(``caller_of``) and puts its tenant in the request it builds
(``GenerationRequest.tenant``). A key is known inside the server by a digest of it
(``Caller.identity``), so the key itself is never kept beside what is stored for it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
from dataclasses import dataclass, field
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from mlxpipe.server.api.tenants import Tenant

ROLES = ("user", "operator")
PRIORITIES = ("interactive", "batch")  # (core/priority.py's classes, in order)
SCOPE_KEY = "mlxpipe.caller"  # where the middleware leaves a request's Caller on its ASGI scope


def _role(value: str) -> str:
    if value not in ROLES:
        raise ValueError(f"role is one of {', '.join(ROLES)}, not {value!r}")
    return value


def _count(name: str):
    def parse(value: str) -> int:
        if not value.isdigit() or int(value) < 1:
            raise ValueError(f"{name} is a whole number, at least 1, not {value!r}")
        return int(value)
    return parse


def _priority(value: str) -> str:
    if value not in PRIORITIES:
        raise ValueError(f"priority is one of {', '.join(PRIORITIES)}, not {value!r}")
    return value


def _models(value: str) -> Tuple[str, ...]:
    names = tuple(n for n in value.split(",") if n)
    if not names:
        raise ValueError("models names at least one model, comma-separated")
    return names


@dataclass(frozen=True)
class KeyPolicy:
    """What one API key may do, from its line of the key file. Each field declares
    how its value is read (``metadata["parse"]``: text -> value, ValueError naming
    what is allowed)."""

    role: str = field(default="user", metadata={"parse": _role})  # "operator": sees every key's activity
    rpm: Optional[int] = field(default=None, metadata={"parse": _count("rpm")})  # requests per minute
    tpm: Optional[int] = field(default=None, metadata={"parse": _count("tpm")})  # tokens (prompt + generated) a minute
    concurrency: Optional[int] = field(default=None, metadata={"parse": _count("concurrency")})  # requests at once
    max_tokens: Optional[int] = field(default=None, metadata={"parse": _count("max_tokens")})  # longest reply asked
    priority: str = field(default="interactive", metadata={"parse": _priority})  # its class in the scheduler
    models: Tuple[str, ...] = field(default=(), metadata={"parse": _models})  # served models it may use (): all

    @property
    def operator(self) -> bool:
        return self.role == "operator"

    @classmethod
    def parse(cls, fields: Sequence[str]) -> "KeyPolicy":
        """The policy a key file line's ``field=value`` words give (ValueError: which
        word, and what is allowed)."""
        known = {f.name: f.metadata["parse"] for f in dataclasses.fields(cls)}
        values: Dict[str, object] = {}
        for word in fields:
            name, eq, value = word.partition("=")
            if not eq or name not in known:
                raise ValueError(f"{word!r} is not a field: fields are written name=value, with the names "
                                 f"{', '.join(known)}")
            if name in values:
                raise ValueError(f"{name} is given twice")
            values[name] = known[name](value)
        return cls(**values)


OPERATOR = KeyPolicy(role="operator")


def _digest(data: bytes, person: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16, person=person).digest()


@dataclass(frozen=True)
class Caller:
    """Who an HTTP request is served as: its API key's identity (a digest; b"" on a
    server without keys) and that key's policy."""

    identity: bytes
    policy: KeyPolicy

    @property
    def operator(self) -> bool:
        return self.policy.operator

    def tenant(self, cache_salt: Optional[str]) -> Tenant:
        """The tenant a request of this caller's with ``cache_salt`` is (prefix cache, stores)."""
        return Tenant(self.identity, cache_salt)


LOCAL = Caller(b"", OPERATOR)  # a server without keys: one user, an operator; `mlxpipe generate`


def parse_key_lines(lines: Sequence[str]) -> List[Tuple[str, KeyPolicy]]:
    """Each ``KEY [field=value ...]`` line as (key, policy); ValueError naming the line
    (by number, never by its key) and what is wrong."""
    out, seen = [], set()
    for number, line in enumerate(lines, 1):
        words = line.split()
        if not words:
            continue
        try:
            policy = KeyPolicy.parse(words[1:])
        except ValueError as err:
            raise ValueError(f"API key {number}: {err}") from None
        if words[0] in seen:
            raise ValueError(f"API key {number} is listed twice")
        seen.add(words[0])
        out.append((words[0], policy))
    return out


class Keys:
    """The API keys a server accepts (``ApiOptions.api_keys``: key file lines), each a
    ``Caller``; none: everyone is ``LOCAL``."""

    def __init__(self, lines: Sequence[str]):
        parsed = parse_key_lines(lines)
        self.keys = [key.encode() for key, _ in parsed]
        self.callers = [Caller(_digest(key, b"mlxpipe-tenant"), policy) for key, (_, policy) in zip(self.keys, parsed)]

    def __bool__(self) -> bool:
        return bool(self.keys)

    def __len__(self) -> int:
        return len(self.keys)

    def caller(self, headers: Mapping[bytes, bytes]) -> Optional[Caller]:
        """The caller whose key the headers present (``Authorization: Bearer <key>``, the
        scheme in any case as RFC 9110 has it, or ``x-api-key: <key>``), ``LOCAL`` on a
        server without keys, else None. Every key is compared, in constant time each."""
        if not self.keys:
            return LOCAL
        scheme, _, credentials = headers.get(b"authorization", b"").partition(b" ")
        bearer = credentials.strip(b" ") if scheme.lower() == b"bearer" else b""
        key = headers.get(b"x-api-key", b"")
        found = None
        for mine, caller in zip(self.keys, self.callers):
            if hmac.compare_digest(bearer, mine) | hmac.compare_digest(key, mine):
                found = caller
        return found


def caller_of(request) -> Caller:
    """The caller the ``ApiKey`` middleware found for ``request`` (a Starlette request
    or an ASGI scope)."""
    scope = getattr(request, "scope", request)
    caller = scope.get(SCOPE_KEY)
    if caller is None:  # a route reached without the middleware: a bug, never a silent tenant
        raise RuntimeError("no caller on this request: the ApiKey middleware did not run")
    return caller
