"""What a command checks before it starts anything, so that a mistake a
restart cannot fix is one line and exit 2 instead of a traceback in each child:
the install flavour has the command's packages, the model names something
loadable, the ports are free."""

from __future__ import annotations

import errno
import importlib.util
import socket

# Each extra (pyproject.toml) and the modules its commands import; a command
# needs its extra's and those of the extras it builds on.
EXTRA_MODULES: dict[str, tuple[str, ...]] = {
    "worker": ("celery", "torch", "transformers", "huggingface_hub", "prometheus_client"),
    "gateway": ("fastapi", "uvicorn", "python_multipart", "httpx", "httpcore", "prometheus_client",
                "jinja2"),
    "exporter": ("prometheus_client",),
    "demo": ("fakeredis", "rich"),  # rich comes with the worker extra
    "bench": ("rich",),
}
EXTRA_NEEDS = {"demo": ("worker",), "bench": ("worker", "gateway")}


class Unfit(Exception):
    """A check failed: the message is the one line to print (exit 2)."""


def missing_modules(extra: str) -> list[str]:
    """The modules of ``extra`` (and of the extras it builds on) not installed here."""
    extras = (*EXTRA_NEEDS.get(extra, ()), extra)
    return [module for e in extras for module in EXTRA_MODULES.get(e, ())
            if importlib.util.find_spec(module) is None]


def need_extra(command: str, extra: str) -> None:
    """Raise ``Unfit`` naming what to install if ``extra`` is not installed."""
    missing = missing_modules(extra)
    if missing:
        raise Unfit(f"tokenfleet {command} needs the {extra} extra (missing here: "
                    f"{', '.join(missing)}): pip install \"tokenfleet[{extra}]\", or "
                    f"\".[{extra}]\" in a clone (docs: Getting started, Install)")


def need_free_port(host: str, port: int, what: str) -> None:
    """Raise ``Unfit`` if ``port`` cannot be bound on ``host`` now: in use, or not ours."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # As the servers do (http.server, uvicorn): a port in TIME_WAIT is free.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            why = ("is in use (another worker's or gateway's?)" if exc.errno == errno.EADDRINUSE
                   else f"cannot be bound ({exc.strerror})")
            raise Unfit(f"{what}: port {port} on {host} {why}; give a free port") from None


def need_model(name: str) -> None:
    """Raise ``Unfit`` unless ``name`` is a loadable model: a built-in name, a
    model directory with what loading needs, or a ``hf:`` id the Hugging Face
    Hub (or its cache) gives now, once for every worker process of the host."""
    from tokenfleet.shared import models

    try:
        models.check(name)
        if name.startswith(models.HUB_PREFIX):
            models.fetch(name)
    except models.ModelError as exc:
        raise Unfit(str(exc)) from None
