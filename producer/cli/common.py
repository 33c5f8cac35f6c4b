"""What every ``tokenfleet`` command shares: options passed on through the environment,
and the failures that end a command, each with its exit code."""

from __future__ import annotations

import os
from typing import Any

import click


ENV_OPTIONS = {  # CLI option -> setting, passed on through the environment
    "redis_url": "TOKENFLEET_REDIS_URL",
    "model": "TOKENFLEET_MODEL",
    "queue": "TOKENFLEET_QUEUE",
    "max_batch": "TOKENFLEET_MAX_BATCH",
    "prefetch": "TOKENFLEET_PREFETCH",
    "namespace": "TOKENFLEET_NAMESPACE",
    "engine": "TOKENFLEET_ENGINE",
}

class Failure(click.ClickException):
    """An everyday failure: one line on stderr, no traceback. Each kind has its
    exit code, so scripts can tell outcomes apart (README, "Exit codes")."""


class JobFailed(Failure):
    exit_code = 1  # the job ended failed, cancelled or expired; or no such job


class BadSetup(Failure):
    exit_code = 2  # as click's usage errors: a model that is not there, a name in use


class NotEnqueued(Failure):
    exit_code = 3  # nothing enqueued: invalid request, queue full, no worker, conflict


class RedisUnreachable(Failure):
    exit_code = 4  # unreachable, wrong credentials, or a malformed URL


class TimedOut(Failure):
    exit_code = 5  # --wait / --stream gave up; the job goes on


class Group(click.Group):
    def invoke(self, ctx: click.Context) -> Any:
        from pydantic import ValidationError
        from redis.exceptions import AuthenticationError, RedisError

        from tokenfleet.shared.file_store import StoreUnwritable
        from tokenfleet.workers.preflight import Unfit

        try:
            return super().invoke(ctx)
        except Unfit as exc:
            raise BadSetup(str(exc)) from None
        except StoreUnwritable as exc:
            raise BadSetup(f"{exc.where()}: pass --files-url file:///a/directory/you/can/write "
                           "(or s3://bucket/prefix), or set TOKENFLEET_FILES_URL") from None
        except ValidationError as exc:
            if exc.title != "Settings":
                raise
            from tokenfleet.shared.settings_check import describe

            raise BadSetup(describe(exc)) from None
        except AuthenticationError as exc:
            raise RedisUnreachable(f"Redis at {shown_url()} refused the credentials: "
                                   f"{exc}") from None
        except RedisError as exc:
            raise RedisUnreachable(f"cannot reach Redis at {shown_url()}: {exc}") from None
        except ValueError as exc:
            if "redis" in str(exc).lower() and "url" in str(exc).lower():
                raise RedisUnreachable(f"bad Redis URL {shown_url()}: {exc}") from None
            raise


def shown_url() -> str:
    """The Redis URL in use, without its password."""
    from tokenfleet.shared.redis.url import redacted

    return redacted(os.environ.get("TOKENFLEET_REDIS_URL", "redis://127.0.0.1:6379/0"))


def apply_env(**options: Any) -> None:
    """Options override the environment, so settings (and child processes) see them."""
    from tokenfleet.shared.settings import get_settings

    for name, value in options.items():
        if value is not None and name in ENV_OPTIONS:
            os.environ[ENV_OPTIONS[name]] = str(value)
    get_settings.cache_clear()


redis_option = click.option("--redis-url", default=None,
                            help="Redis URL (default: $TOKENFLEET_REDIS_URL)")
