"""Redis clients that ride out a restart or a dropped connection, and fail fast
when there was never a connection to ride out.

Commands are retried with exponential backoff on connection errors and timeouts
once the client has been connected, so a producer or worker waits for a
restarted Redis instead of dying; callers with loops of their own (the feeder,
subscribers) also back off. Before the first successful connection nothing is
retried: a wrong host or port, or a Redis that is not up, is one clear error
(``RedisUnavailable``) within the connect timeout, not 13 s of backoff and a
traceback. Refused credentials (``RedisAuthFailed``) and missing permissions are
never retried: they do not change by waiting.
``rediss://`` and ``user:password@`` URLs work as redis-py parses them.

``redis+cluster://host:port`` (``rediss+cluster://`` with TLS), any node, gives
a Redis Cluster client instead. It offers the commands, scripts, pipelines and
pub/sub the fleet uses; the keys of each script share a slot (``keys.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import random
from collections.abc import Coroutine
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis
import redis.asyncio as aioredis
import redis.asyncio.cluster as aiocluster
import redis.cluster
from redis.asyncio.retry import Retry as AsyncRetry
from redis.backoff import ExponentialBackoff
from redis.exceptions import AuthenticationError, AuthorizationError, ConnectionError, TimeoutError
from redis.retry import Retry

from tokenfleet.shared.errors import RedisAuthFailed, RedisUnavailable, TokenfleetError

# Ten retries with a backoff capped at 2 s ride out a restart of ~15 s.
RETRIES = 10
# Each live stream()/wait() holds a pub/sub connection of its own: a web backend
# following hundreds of jobs needs more than redis-py's default of 100.
MAX_CONNECTIONS = 2000
# How long one TCP connect may take: also the bound on a first connect that fails.
CONNECT_TIMEOUT_S = 3.0
RETRY_ERRORS: list[type[Exception]] = [ConnectionError, TimeoutError, ConnectionResetError]


def _backoff() -> ExponentialBackoff:
    """The pause before each retry: 0.1 s, doubling, at most 2 s."""
    return ExponentialBackoff(cap=2.0, base=0.05)


def redacted(url: str) -> str:
    """The URL with its password replaced by ``***``, fit for an error message."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    port = f":{parts.port}" if parts.port else ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}{port}"))


class _Link:
    """Whether a client has ever reached Redis; shared by all its connections.

    redis-py deep-copies the retry policy into every connection of a pool, so
    the policies below share one of these instead of each keeping its own.
    """

    def __init__(self, url: str) -> None:
        self.url = redacted(url)
        self.up = False


def _give_up(link: _Link, error: Exception) -> Exception | None:
    """The error to raise at once instead of retrying, or None to retry."""
    if isinstance(error, TokenfleetError | AuthorizationError):
        return error  # already explained (a nested retry), or a missing ACL permission
    if isinstance(error, AuthenticationError):
        return RedisAuthFailed(link.url, error)
    if not link.up:
        return RedisUnavailable(link.url, error)
    return None


class _Linked:
    """What both retry loops share: the backoff, and one link for all the copies
    redis-py makes of a retry (one per connection)."""

    _backoff: Any

    def __init__(self, link: _Link) -> None:
        super().__init__(_backoff(), RETRIES)  # type: ignore[call-arg]
        self.link = link

    def __deepcopy__(self, memo: dict[int, Any]) -> Any:
        other = copy.copy(self)
        other._backoff = copy.deepcopy(self._backoff, memo)
        return other  # the link stays shared


class _FailFastRetry(_Linked, Retry):
    """redis-py's retry loop, except as :func:`_give_up` says."""

    def call_with_retry(self, do: Any, fail: Any, is_retryable: Any = None,
                        with_failure_count: bool = False) -> Any:
        self._backoff.reset()
        failures = 0
        while True:
            try:
                result = do()
                self.link.up = True
                return result
            except self._supported_errors as error:
                if is_retryable and not is_retryable(error):
                    raise
                failures += 1
                fail(error, failures) if with_failure_count else fail(error)
                now = _give_up(self.link, error)
                if now is not None:
                    raise now from (None if now is error else error)
                if self._retries >= 0 and failures > self._retries:
                    raise
                _sleep(self._backoff.compute(failures))


class _AsyncFailFastRetry(_Linked, AsyncRetry):
    """The asyncio twin of :class:`_FailFastRetry`."""

    async def call_with_retry(self, do: Any, fail: Any, is_retryable: Any = None,
                              with_failure_count: bool = False) -> Any:
        import asyncio

        self._backoff.reset()
        failures = 0
        while True:
            try:
                result = await do()
                self.link.up = True
                return result
            except self._supported_errors as error:
                if is_retryable and not is_retryable(error):
                    raise
                failures += 1
                await (fail(error, failures) if with_failure_count else fail(error))
                now = _give_up(self.link, error)
                if now is not None:
                    raise now from (None if now is error else error)
                if self._retries >= 0 and failures > self._retries:
                    raise
                await asyncio.sleep(self._backoff.compute(failures))


def _sleep(seconds: float) -> None:
    import time

    time.sleep(seconds)  # the backoff between two tries of a dropped connection


def _options() -> dict[str, Any]:
    return {
        "decode_responses": False,
        "health_check_interval": 30,
        "socket_keepalive": True,
        "socket_connect_timeout": CONNECT_TIMEOUT_S,
        # A half-open connection (a peer gone without a FIN) fails instead of
        # hanging a thread forever; far above any BLOCK the fleet uses.
        "socket_timeout": 60,
        "retry_on_error": RETRY_ERRORS,
        "max_connections": MAX_CONNECTIONS,
    }


# The schemes of a Redis Cluster URL, and the plain scheme of its nodes.
CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}


def is_cluster(url: str) -> bool:
    return urlsplit(url).scheme in CLUSTER_SCHEMES


def node_url(url: str, host: str | None = None, port: int | None = None) -> str:
    """A plain URL of one node: the cluster URL's node, or ``host:port`` with the
    same scheme, credentials and options."""
    parts = urlsplit(url)
    scheme = CLUSTER_SCHEMES.get(parts.scheme, parts.scheme)
    netloc = parts.netloc
    if host is not None:
        auth = netloc.rpartition("@")[0]
        netloc = (auth + "@" if auth else "") + (f"[{host}]" if ":" in host else host) + f":{port}"
    return urlunsplit(parts._replace(scheme=scheme, netloc=netloc))


class _Cluster(redis.cluster.RedisCluster):
    """redis-py's cluster client, whose commands ride out a failover.

    Its own loop retries a command that met a connection error at once, reading
    the slot map again each time: a master that died is still in the map until
    its replica is promoted (the cluster's node timeout and an election later, a
    second or more), so all its tries go to the dead node and the command fails.
    Here that whole loop is retried with the backoff a single Redis's client has
    (``RETRIES``), so a failover is ridden out as a restart is.
    """

    def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        once = super().execute_command

        def node_errors() -> Any:
            try:
                return once(*args, **kwargs)  # type: ignore[no-untyped-call]
            except (redis.exceptions.RedisClusterException, *_NOT_SERVED) as error:
                raise _node_error(error) from error

        return self.retry.call_with_retry(node_errors, _ignore)


def _ignore(error: Exception, *failures: int) -> None:
    """A failed try needs nothing undone: the cluster client dropped the connection."""


# A cluster not serving the slot yet, which ran nothing: its nodes coming back
# from a restart, a replica being promoted. redis-py's own loop tries these a few
# times in a fraction of a second; a restart takes seconds.
_NOT_SERVED = (redis.exceptions.ClusterDownError, redis.exceptions.TryAgainError,
               redis.exceptions.MasterDownError)


def _node_error(error: Exception) -> Exception:
    """The error of the node under redis-py's "Redis Cluster cannot be connected":
    its cluster client reads the slot map again after a connection error, and
    reports no node answering (every node restarting, a wrong password) as a
    RedisClusterException whose cause is the last node's error. Raised as that
    error, it is what a single Redis's client meets in the same case: retried
    with backoff (a connection error once the client has been up, so a restart
    of the whole cluster is ridden out), or refused at once (a wrong password,
    a first connect that failed: ``_give_up``)."""
    if isinstance(error, _NOT_SERVED):
        return ConnectionError(f"{type(error).__name__}: {error}")
    cause = error.__cause__
    if isinstance(cause, ConnectionError | TimeoutError):  # AuthenticationError included
        return type(cause)(*cause.args)
    return error


def _cluster_error(link: _Link, error: Exception) -> Exception:
    """As ``_node_error``, outside the retry loop (a client being made, a slot map
    read for a pub/sub): a backend that catches ``RedisAuthFailed`` or
    ``RedisUnavailable`` catches them on a cluster too."""
    node = _node_error(error)
    return _give_up(link, node) or node


def resubscribe_after(client: Any, failures: int) -> bool:
    """Whether a pub/sub whose connection failed for good (redis-py's retries
    spent) should be made again, after a pause: on a cluster, yes, up to
    ``RETRIES`` times, with the slot map read again, since a replica may have
    taken the channel's node's place; on one Redis, no: it is down.
    """
    if not isinstance(client, redis.cluster.RedisCluster) or failures > RETRIES:
        return False
    _sleep(_backoff().compute(failures))
    with contextlib.suppress(redis.exceptions.RedisError):
        client.nodes_manager.initialize()
    return True


def connect(url: str) -> redis.Redis:
    if is_cluster(url):
        link = _Link(url)
        try:  # it reads the slot map at once
            client = _Cluster.from_url(node_url(url), retry=_FailFastRetry(link), **_options())
        except redis.exceptions.RedisClusterException as error:
            raise _cluster_error(link, error) from error
        link.up = True  # a node answered: from now on a lost connection is ridden out
        # Typed as a plain client: RedisCluster answers every command the fleet sends.
        return client  # type: ignore[return-value]
    return redis.Redis.from_url(url, retry=_FailFastRetry(_Link(url)), **_options())


class _AsyncCluster(aiocluster.RedisCluster):
    """redis-py's asyncio cluster client, whose pub/sub goes through a plain
    client of one node (a PUBLISH reaches the subscribers of every node).

    Its own pub/sub borrows a connection of a node's command pool and hands it
    back disconnected when it closes. Under the gateway, with streams opening
    and closing by the hundred, commands then failed on the nodes' connections
    (AttributeError: no writer; RuntimeError: handler is closed; redis-py 8.1).
    With subscriptions off the command pools most of those failures went; the
    rest are ridden out in ``execute_command`` (README, "Redis Cluster").
    """

    url: str  # the cluster URL, for the nodes' plain URLs
    _plain: dict[str, aioredis.Redis]
    lost: set[str]  # nodes a pub/sub lost its connection to: passed over by pubsub()

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        """As ``_Cluster.execute_command``: a failover is ridden out as a restart
        is. And a caller cancelled mid-command (a stream whose client hung up)
        does not cancel the command: it finishes in a task of its own."""
        once = super().execute_command

        async def sent_once() -> Any:
            try:
                return await once(*args, **kwargs)
            except (redis.exceptions.RedisClusterException, *_NOT_SERVED) as error:
                raise _node_error(error) from error
            except (AttributeError, RuntimeError) as error:
                if not _unsent(error):
                    raise
                raise ConnectionError(f"the connection closed under the command: {error}") from error

        return await _uncancelled(self.retry.call_with_retry(sent_once, _aignore))

    async def initialize(self, *args: Any, **kwargs: Any) -> Any:
        link = self.retry.link  # type: ignore[attr-defined]
        try:
            client = await super().initialize(*args, **kwargs)
        except redis.exceptions.RedisClusterException as error:
            raise _cluster_error(link, error) from error
        # A node answered, as a single Redis's client is up once a connection is
        # made: a stream whose pub/sub read the slot map, then lost Redis before
        # its first command, rides out the restart instead of failing at once.
        link.up = True
        return client

    def pubsub(self, node: Any = None, host: Any = None, port: Any = None, **kwargs: Any) -> Any:
        """A pub/sub on a plain connection to a node of our choosing (the
        arguments that would pick one are ignored)."""
        # The slot map is read (see ``ready``); a node just lost may still be in it.
        nodes = [n for n in self.get_nodes() if n.name not in self.lost]
        if not nodes:
            self.lost.clear()
            nodes = self.get_nodes()
        chosen = random.choice(nodes)
        plain = self._plain.get(chosen.name)
        if plain is None:
            plain = self._plain[chosen.name] = connect_async(
                node_url(self.url, chosen.host, int(chosen.port)))
        return plain.pubsub(**kwargs)

    async def aclose(self) -> None:
        for plain in self._plain.values():
            await plain.aclose()
        await super().aclose()


async def _aignore(error: Exception, *failures: int) -> None:
    """As ``_ignore``."""


# What redis-py 8.1's asyncio connection raises when it writes a command on a
# connection another task closed under it (the cluster client closes a node's
# idle connections while they stay on its free list, after a connection error on
# that node): no writer any more, or a closed transport. Nothing was written,
# and redis-py dropped the connection: the command can go again.
_UNSENT = ("object has no attribute 'writelines'", "the handler is closed")


def _unsent(error: Exception) -> bool:
    return any(text in str(error) for text in _UNSENT)


async def _uncancelled(command: Coroutine[Any, Any, Any]) -> Any:
    """Await ``command`` in a task of its own, which the caller's cancel does
    not reach (the caller still stops at once).

    redis-py 8.1's asyncio cluster client takes a command's connection off the
    node's free list and puts it back in a ``finally``, also when the command
    was cancelled between its write and its reply. Under the gateway's hang-ups
    that left connections with a reply nobody read or half a command written;
    the next command on them failed or read another's reply, the client
    dropped the node's connections while other commands used them, and those
    failed with AttributeError (no writer): requests answered 500. A command
    that always runs to its end leaves its connection whole."""
    task = asyncio.ensure_future(command)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        # Nobody waits for it any more: its outcome is dropped, not logged as
        # an exception never retrieved.
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        raise


async def left_node(client: Any, pubsub: Any) -> bool:
    """On a cluster client, pass over the node ``pubsub`` was connected to (it may
    be gone for good: a master whose replica took over) and read the slot map
    again; True. On one Redis, False."""
    if not isinstance(client, _AsyncCluster):
        return False
    connection = getattr(pubsub, "connection", None)
    if connection is not None:
        client.lost.add(f"{connection.host}:{connection.port}")
    with contextlib.suppress(redis.exceptions.RedisError, OSError):
        await client.nodes_manager.initialize()
    return True


def connect_async(url: str) -> aioredis.Redis:
    if is_cluster(url):
        client: Any = _AsyncCluster.from_url(node_url(url), retry=_AsyncFailFastRetry(_Link(url)),
                                             **_options())
        client.url, client._plain, client.lost = url, {}, set()
        return client  # type: ignore[no-any-return]
    return aioredis.Redis.from_url(url, retry=_AsyncFailFastRetry(_Link(url)), **_options())


def node_client(client: Any, key: str) -> Any:
    """The plain client of the node that holds ``key`` (the client itself when it
    is not a cluster's): for raw connections, which a cluster client has none of."""
    if isinstance(client, redis.cluster.RedisCluster):
        return client.get_node_from_key(key).redis_connection  # type: ignore[no-untyped-call]
    return client


async def ready(client: Any) -> Any:
    """``client`` once it may open a pub/sub: a cluster client reads the slot map first."""
    if isinstance(client, aiocluster.RedisCluster):
        await client.initialize()
    return client


def broker_url(url: str, celery_prefix: str) -> str:
    """Celery's broker: the Redis itself, or on a cluster the node that holds
    Celery's keys (one hash tag: ``Keys.celery_prefix``); Kombu's Redis transport
    speaks to one server, not to a cluster."""
    if not is_cluster(url):
        return url
    client = connect(url)
    try:
        node = client.get_node_from_key(celery_prefix)  # type: ignore[attr-defined]
        return node_url(url, node.host, int(node.port))
    finally:
        client.close()


def text(value: bytes | str | None) -> str | None:
    if value is None:
        return None
    return value.decode() if isinstance(value, bytes) else value


def decode_hash(fields: dict[bytes, bytes]) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in fields.items()}
