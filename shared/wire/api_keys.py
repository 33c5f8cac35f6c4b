"""API keys of the gateway: made and revoked by ``tokenfleet keys``, looked up by
every gateway in Redis.

A key is ``tfk_<key id>_<secret>``. Redis holds its record (``ApiKey``) under
the SHA-256 of the whole key, so a copy of Redis gives no usable key; the key
id (public, in ``keys list``) names it for ``keys revoke``. A gateway looks a
key up on its requests and keeps the answer for at most ``cache_s`` (under a
second), so a new or revoked key holds on every gateway within that time.

The console's sign-in (``open_sign_in``) gives the browser a token instead
of the key: Redis keeps the key's SHA-256 under the token's for the
sign-in's life, and a request with the token is the key's while both exist.

Making a key also marks the fleet as one that has had keys (``api_keys_made``);
no revoke clears the mark, so revoking the last key (after a leak) leaves an
``auto`` gateway asking for keys, not open to everyone.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from typing import Any

from tokenfleet.shared.wire.keys import Keys
from tokenfleet.shared.wire.schemas import ApiKey

PREFIX = "tfk_"


def digest(key: str) -> str:
    """The SHA-256 of a key (hex): the name its record is stored under."""
    return hashlib.sha256(key.encode()).hexdigest()


def new_key() -> tuple[str, str]:
    """A new key and its id: 12 hex digits of id, 256 random bits of secret."""
    key_id = secrets.token_hex(6)
    return f"{PREFIX}{key_id}_{secrets.token_urlsafe(32)}", key_id


def create_key(redis: Any, keys: Keys, record: ApiKey, key: str) -> None:
    """Store ``key``'s record. The listing goes first: a crash in between
    leaves a listed key that does not work yet (``keys revoke`` clears it),
    never a usable key that ``keys list`` does not show. The mark that keys
    were made goes before both: no key exists without it."""
    redis.set(keys.api_keys_made, record.created_at, nx=True)
    redis.hset(keys.api_keys, record.key_id, digest(key))
    redis.set(keys.api_key(digest(key)), record.model_dump_json())


def list_keys(redis: Any, keys: Keys) -> list[ApiKey]:
    """Every key's record, oldest first (no secret is stored to show)."""
    digests = redis.hgetall(keys.api_keys)
    pipe = redis.pipeline(transaction=False)
    for value in digests.values():
        pipe.get(keys.api_key(_text(value)))
    records = [ApiKey.model_validate_json(raw) for raw in pipe.execute() if raw]
    return sorted(records, key=lambda r: r.created_at)


async def list_keys_async(redis: Any, keys: Keys) -> list[ApiKey]:
    """``list_keys`` on an asyncio client (the console's keys page)."""
    digests = await redis.hgetall(keys.api_keys)
    pipe = redis.pipeline(transaction=False)
    for value in digests.values():
        pipe.get(keys.api_key(_text(value)))
    records = [ApiKey.model_validate_json(raw) for raw in await pipe.execute() if raw]
    return sorted(records, key=lambda r: r.created_at)


def revoke_key(redis: Any, keys: Keys, key_id: str) -> bool:
    """Delete a key by its id; False when no such key. The record goes first,
    so the key fails at once even if the listing's entry outlives a crash."""
    found = redis.hget(keys.api_keys, key_id)
    if found is None:
        return False
    redis.delete(keys.api_key(_text(found)))
    redis.hdel(keys.api_keys, key_id)
    redis.hdel(keys.api_keys_used, key_id)
    return True


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def open_sign_in(redis: Any, keys: Keys, key: str, ttl_s: int) -> Any:
    """Sign in to the console with ``key`` (known to exist): the awaitable of
    its write, and the token the browser keeps."""
    token = secrets.token_urlsafe(32)
    return redis.set(keys.console_sign_in(digest(token)), digest(key), ex=ttl_s), token


def close_sign_in(redis: Any, keys: Keys, token: str) -> Any:
    return redis.delete(keys.console_sign_in(digest(token)))


# How often a gateway writes a key's last use (per key): a request's own cost
# stays a read.
USE_EVERY_S = 60.0


class KeyBook:
    """A gateway's view of the keys: ``lookup`` a presented key, ``ever_made``;
    each answer is kept ``cache_s`` (monotonic clock), unknown keys included,
    so a flood of bad keys costs Redis one read per key and interval."""

    def __init__(self, redis: Any, keys: Keys, cache_s: float) -> None:
        self.redis, self.keys, self.cache_s = redis, keys, cache_s
        self._found: dict[str, tuple[float, ApiKey | None]] = {}
        self._made: tuple[float, bool] | None = None
        # Once seen, for the life of this process: Redis losing its data (a
        # FLUSHALL, a restart without persistence) does not open a running gateway.
        self._seen_made = False
        self._noted: dict[str, float] = {}  # key id -> when its use was last written

    async def lookup(self, key: str) -> ApiKey | None:
        return await self.lookup_digest(digest(key))

    async def signed_in(self, token: str) -> ApiKey | None:
        """The key of a console sign-in token, or None: no such sign-in (signed out,
        or past its life), or its key revoked. Read each time: a sign-out holds at once."""
        name = await self.redis.get(self.keys.console_sign_in(digest(token)))
        return None if name is None else await self.lookup_digest(_text(name))

    def note_use(self, record: ApiKey) -> Any:
        """The write of ``record``'s last use, when due (else None): at most
        once every ``USE_EVERY_S`` per key from this gateway."""
        now = time.monotonic()
        if self._noted.get(record.key_id, 0.0) > now:
            return None
        if len(self._noted) > 10_000:
            self._noted.clear()
        self._noted[record.key_id] = now + USE_EVERY_S
        return self.redis.hset(self.keys.api_keys_used, record.key_id, repr(time.time()))

    async def lookup_digest(self, name: str) -> ApiKey | None:
        """The record stored under a key's SHA-256 (``lookup``, ``signed_in``)."""
        now = time.monotonic()
        cached = self._found.get(name)
        if cached is not None and cached[0] > now:
            return cached[1]
        raw = await self.redis.get(self.keys.api_key(name))
        record = ApiKey.model_validate_json(raw) if raw else None
        if len(self._found) > 10_000:  # a flood of made-up keys: start over
            self._found.clear()
        self._found[name] = (now + self.cache_s, record)
        return record

    async def ever_made(self) -> bool:
        """Whether a key was ever made on this fleet (revoked since or not)."""
        if self._seen_made:
            return True
        now = time.monotonic()
        if self._made is not None and self._made[0] > now:
            return self._made[1]
        made = bool(await self.redis.exists(self.keys.api_keys_made))
        if not made and await self.redis.hlen(self.keys.api_keys):
            # Keys made before the mark existed: mark them now.
            await self.redis.set(self.keys.api_keys_made, time.time(), nx=True)
            made = True
        self._seen_made = made
        self._made = (now + self.cache_s, made)
        return made

