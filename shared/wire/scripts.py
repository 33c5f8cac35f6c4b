"""The fleet's Lua scripts, kept as ``.lua`` files, and how a typed call runs one.

Each script makes one multi-key change atomic (admission, ownership, the final
write before the acknowledgement); see the comment at the top of each file. Its
binding (``client_scripts`` for the producer's, ``worker_scripts`` for the
worker's) takes the script's keys and arguments as typed parameters and gives a
:class:`ScriptCall`, whose ``decode`` turns the reply into a dataclass or an
enum: no caller indexes a reply.

A call runs by ``EVALSHA`` of the SHA1 of its source (what Redis names a script
by); a server that does not know it (a restart, ``SCRIPT FLUSH``) answers
NOSCRIPT, and the call is sent again as ``EVAL`` with the source, which the
server keeps for the next ``EVALSHA``. Like the ``EVALSHA`` it goes to the node
of its keys: a ``SCRIPT LOAD`` of a Redis Cluster client goes to every master,
and fails while one of them is down, though the call's own node is up. A caller that
pipelines by hand sends :meth:`ScriptCall.command` and, on NOSCRIPT,
:func:`load` s the scripts before it sends the calls again.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from functools import cache
from importlib import resources
from typing import Generic, Protocol, TypeVar

from redis.exceptions import NoScriptError

# What a script's argument may be: redis-py encodes each as a bulk string.
Arg = str | bytes | int | float

R = TypeVar("R", covariant=True)

# A line '-- include: NAME.lua' is replaced by that fragment (Lua has no
# require in Redis): a rule several scripts share is written once.
_INCLUDE = re.compile(r"^-- include: ([a-z_]+)\.lua$", re.MULTILINE)

# A script that tells a job's subscribers publishes with ``redis.call(PUBLISH,
# ...)``: the variable is set before its source, to SPUBLISH for a Redis
# Cluster (a shard channel's messages stay on the shard that owns its slot,
# instead of crossing the cluster bus to every node) or to PUBLISH. One source,
# two variants, each with its SHA1.
_PUBLISH = "local PUBLISH = '{}'\n"


class SyncRedis(Protocol):
    """The commands a script call needs of a blocking client (one server, a
    cluster, or one node's client)."""

    def evalsha(self, sha: str, numkeys: int, *keys_and_args: Arg) -> object: ...

    def eval(self, script: str, numkeys: int, *keys_and_args: Arg) -> object: ...

    def script_load(self, script: str) -> object: ...


class AsyncRedis(Protocol):
    """The commands a script call needs of an asyncio client."""

    def evalsha(self, sha: str, numkeys: int, *keys_and_args: Arg) -> Awaitable[object]: ...

    def eval(self, script: str, numkeys: int, *keys_and_args: Arg) -> Awaitable[object]: ...

    def script_load(self, script: str) -> Awaitable[object]: ...


def _read(filename: str) -> str:
    return resources.files("tokenfleet.shared.wire").joinpath(f"lua/{filename}").read_text(encoding="utf-8")


@dataclass(frozen=True)
class Script:
    """One script: its name (the ``.lua`` file), its source with the fragments
    it includes, and the SHA1 Redis knows it by."""

    name: str
    source: str
    sha: str


@cache
def script(name: str, sharded: bool = False) -> Script:
    """The script of ``shared/wire/lua/<name>.lua``, read once; ``sharded``: its
    per-job channels are shard channels (``Keys.sharded``)."""
    body = _INCLUDE.sub(lambda m: _read(f"{m.group(1)}.lua"), _read(f"{name}.lua"))
    source = _PUBLISH.format("SPUBLISH" if sharded else "PUBLISH") + body
    return Script(name, source, hashlib.sha1(source.encode()).hexdigest())


@dataclass(frozen=True)
class ScriptCall(Generic[R]):
    """One call of a script: its keys and arguments, and how its reply reads.

    ``run`` (blocking client) and ``run_async`` (asyncio client) send it and
    decode the reply; ``command`` and ``decode`` serve a caller that sends it
    in a pipeline of its own.
    """

    script: Script
    keys: tuple[str, ...]
    args: tuple[Arg, ...]
    decode: Callable[[object], R]

    def command(self) -> tuple[Arg, ...]:
        """The ``EVALSHA`` command, as a packer or ``execute_command`` takes it."""
        return ("EVALSHA", self.script.sha, len(self.keys), *self.keys, *self.args)

    def run(self, client: SyncRedis) -> R:
        n = len(self.keys)
        try:
            reply = client.evalsha(self.script.sha, n, *self.keys, *self.args)
        except NoScriptError:
            reply = client.eval(self.script.source, n, *self.keys, *self.args)
        return self.decode(reply)

    async def run_async(self, client: AsyncRedis) -> R:
        n = len(self.keys)
        try:
            reply = await client.evalsha(self.script.sha, n, *self.keys, *self.args)
        except NoScriptError:
            reply = await client.eval(self.script.source, n, *self.keys, *self.args)
        return self.decode(reply)


def load(client: SyncRedis, scripts: Iterable[Script]) -> None:
    """``SCRIPT LOAD`` each script (once each), for a caller whose pipelined
    ``EVALSHA`` was answered NOSCRIPT. The SHA1 does not change: it is the source's."""
    for one in {s.name: s for s in scripts}.values():
        client.script_load(one.source)


# -- decoding replies: Redis answers bulk strings as bytes, integers as int ------


def text(reply: object) -> str:
    """A bulk or status reply as text."""
    if isinstance(reply, bytes):
        return reply.decode()
    if isinstance(reply, str):
        return reply
    raise TypeError(f"expected a string reply, got {reply!r}")


def integer(reply: object) -> int:
    """An integer reply (or a string of one)."""
    if isinstance(reply, int):
        return reply
    return int(text(reply))


def items(reply: object) -> list[object]:
    """An array reply."""
    if not isinstance(reply, list):
        raise TypeError(f"expected an array reply, got {reply!r}")
    return reply
