"""Engines by name: the ``tokenfleet.engines`` entry-point group.

An engine is an ``Engine`` subclass (``tokenfleet.workers.engine``) and a
factory that builds it from the settings (``EngineFactory``). The distribution
that ships them registers the factory under the engine's name::

    [project.entry-points."tokenfleet.engines"]
    mine = "my_package.my_engine:build"

and ``TOKENFLEET_ENGINE=mine`` (or ``tokenfleet worker --engine mine``) picks
it. tokenfleet registers its own the same way: ``hf`` (the built-in
engine), ``vllm`` and ``gpu-sim`` (a simulated GPU step, for the benchmark).
A name is looked up when a worker is built, so the settings take any string,
the command line any installed name, and importing this module loads no engine.
"""

from __future__ import annotations

from importlib.metadata import EntryPoint, entry_points
from typing import TYPE_CHECKING, NamedTuple, Protocol

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from tokenfleet.shared.settings import Settings
    from tokenfleet.workers.engine import Engine

GROUP = "tokenfleet.engines"
BUILT_IN = ("gpu-sim", "hf", "vllm")  # what tokenfleet's own metadata registers


class BuiltEngine(NamedTuple):
    """What a factory returns: a ready engine, the tokenizer the worker admits
    and detokenizes its jobs with (the model's), and the settings the worker
    runs by, with ``max_batch`` and ``max_batch_tokens`` as numbers (those left
    at "auto" sized for this engine: ``tokenfleet.workers.budget``)."""

    engine: Engine
    tokenizer: PreTrainedTokenizerBase
    settings: Settings


class EngineFactory(Protocol):
    """What an entry point of the group names: builds the engine the settings
    ask for (``settings.model`` on ``settings.device``). Called once per
    worker process, before the worker starts; an error it raises stops the
    worker from starting, with that error's message in its log."""

    def __call__(self, settings: Settings) -> BuiltEngine: ...


class UnknownEngine(ValueError):
    """No installed distribution registers an engine by that name."""


def names() -> list[str]:
    """The names of the engines installed in this environment, sorted."""
    return sorted({entry.name for entry in entry_points(group=GROUP)})


def factory(name: str) -> EngineFactory:
    """The factory of the engine registered as ``name``; ``UnknownEngine``
    (listing the installed names) when there is none."""
    found = entry_points(group=GROUP, name=name)
    targets = {entry.value for entry in found}
    if not targets:
        raise UnknownEngine(_unknown(name))
    if len(targets) > 1:
        raise UnknownEngine(f"engine {name!r} is registered more than once: "
                            f"{', '.join(_origin(e) for e in found)}; uninstall all but one")
    loaded: EngineFactory = next(iter(found)).load()
    return loaded


def _unknown(name: str) -> str:
    installed = names()
    message = (f"no engine named {name!r} (TOKENFLEET_ENGINE, --engine): the installed engines "
               f"are {', '.join(installed) or 'none'}. An engine is installed with the "
               f"distribution that registers it under the {GROUP!r} entry points")
    if not set(BUILT_IN) <= set(installed):
        # An install made before the group (or one of tokenfleet's own) existed.
        message += (f"; some of tokenfleet's own ({', '.join(BUILT_IN)}) are missing, so its "
                    "installed metadata is out of date: install tokenfleet again "
                    "(pip install -e . in a checkout)")
    return message


def _origin(entry: EntryPoint) -> str:
    dist = entry.dist
    return f"{entry.value} by {dist.name if dist is not None else 'an unknown distribution'}"
