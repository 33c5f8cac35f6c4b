"""Structured output on the built-in engine: xgrammar grammars compiled off
the engine thread, a matcher per sequence, and the token mask of a step.

A spec (``StructuredOutput``) is compiled once per worker and cached by its
digest, in runner processes that end at ``TOKENFLEET_GRAMMAR_COMPILE_S``
(``tokenfleet.shared.budgeted``): the engine thread only submits the compile
and, until it is done, leaves the sequence out of its batches, so
unconstrained jobs never wait on a schema, and a compile over the budget
fails its job naming the limit (the spec is then refused at once). The cache
is bounded in bytes (``TOKENFLEET_GRAMMAR_CACHE_MB``). Each constrained
sequence then gets a matcher, fed every token it has (a resumed job's logged tokens first),
which fills the sequence's row of the step's token mask and accepts the token
drawn for it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import xgrammar as xgr

from tokenfleet.shared import budgeted
from tokenfleet.shared.grammar_check import over_budget
from tokenfleet.shared.wire.structured import StructuredOutput

# Compiles at once per worker: each waits on its own runner process, so a
# pathological schema holds back only the compiles queued behind all of these.
COMPILE_THREADS = 4
# Refusals kept (a digest and a sentence each).
REFUSALS_KEPT = 4096
CACHE_SETTING = "TOKENFLEET_GRAMMAR_CACHE_MB"


class GrammarRefused(Exception):
    """A spec this worker will not compile; the message names it and why."""


class Grammars:
    """Compiles specs for one model's tokenizer, each once, in runner processes
    (``tokenfleet.shared.budgeted``) within ``budget_s``; keeps the compiled
    grammars up to ``cache_bytes`` and the refusals by digest."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int],
                 budget_s: float, cache_bytes: int, threads: int = COMPILE_THREADS) -> None:
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="grammar")
        self._budget_s, self._cache_bytes = budget_s, cache_bytes
        self._children = budgeted.Children(PRELOAD)
        # Reading the vocabulary takes a while for a large one: off the caller's thread too.
        stops = sorted(stop_token_ids)
        self._info = self._executor.submit(lambda: _described(xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=stops)))
        self._cache: OrderedDict[str, Future[xgr.CompiledGrammar]] = OrderedDict()
        self._bytes: dict[str, int] = {}  # of the compiled grammars in the cache
        self._refused: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, spec: StructuredOutput) -> Future[xgr.CompiledGrammar]:
        """The compiled grammar of ``spec``, now or later (``GrammarRefused``
        when it will not be): never blocks."""
        key = spec.key()
        with self._lock:
            refused = self._refused.get(key)
            if refused is not None:
                failed: Future[xgr.CompiledGrammar] = Future()
                failed.set_exception(GrammarRefused(refused.replace(_LABEL, spec.label)))
                return failed
            found = self._cache.get(key)
            if found is not None and not (found.done() and found.exception() is not None):
                self._cache.move_to_end(key)
                return found
            future = self._executor.submit(self._compile, key, spec)
            self._cache[key] = future
            return future

    @property
    def cached_bytes(self) -> int:
        """What the compiled grammars kept weigh."""
        with self._lock:
            return sum(self._bytes.values())

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._children.close()

    def _compile(self, key: str, spec: StructuredOutput) -> xgr.CompiledGrammar:
        info, described = self._info.result()
        how, source = spec.ebnf_or_source()
        try:
            serialized = self._children.run(compile_in_runner, [described, how, source],
                                            self._budget_s)
            compiled = xgr.CompiledGrammar.deserialize_json(serialized, info)
        except budgeted.OverBudget:
            raise self._refuse(key, over_budget(_LABEL, self._budget_s), spec) from None
        except budgeted.ChildFailed as exc:
            raise self._refuse(key, f"{_LABEL} could not be compiled for this model: {exc}",
                               spec) from None
        size = compiled.memory_size_bytes
        if size > self._cache_bytes:
            raise self._refuse(key, f"{_LABEL} compiles to {size / 2**20:.1f} MiB, above this "
                               f"worker's limit of {self._cache_bytes / 2**20:g} MiB "
                               f"({CACHE_SETTING})", spec)
        with self._lock:
            if key in self._cache:
                self._bytes[key] = size
            # Least recently used first: bounded in bytes, whatever each weighs.
            while sum(self._bytes.values()) > self._cache_bytes:
                oldest = next(k for k in self._cache if k in self._bytes)
                del self._cache[oldest], self._bytes[oldest]
        return compiled

    def _refuse(self, key: str, sentence: str, spec: StructuredOutput) -> GrammarRefused:
        # Kept with a placeholder for the label: the digest leaves a schema's name out.
        with self._lock:
            self._refused[key] = sentence
            while len(self._refused) > REFUSALS_KEPT:
                self._refused.popitem(last=False)
            self._cache.pop(key, None)
        return GrammarRefused(sentence.replace(_LABEL, spec.label))


_LABEL = "{label}"
# What a runner imports before it is forked: the compile needs xgrammar and this module.
PRELOAD = ("xgrammar", "tokenfleet.workers.grammar")
_compilers: dict[str, xgr.GrammarCompiler] = {}  # in a runner: one per tokenizer


def _described(info: xgr.TokenizerInfo) -> tuple[xgr.TokenizerInfo, str]:
    return info, info.serialize_json()


def compile_in_runner(ready: Any, described: str, how: str, source: str) -> str:
    """In a runner process: the compiled grammar of ``source``, serialized."""
    compiler = _compilers.get(described)
    if compiler is None:  # reading the vocabulary is setup, not charged to the spec
        _compilers.clear()
        compiler = _compilers[described] = xgr.GrammarCompiler(
            xgr.TokenizerInfo.deserialize_json(described), cache_enabled=False)
    ready()
    if how == "json":
        # Compact JSON: free whitespace lets a weak model pad forever.
        compiled = compiler.compile_json_schema(source, any_whitespace=False)
    elif how == "regex":
        compiled = compiler.compile_regex(source)
    else:
        compiled = compiler.compile_grammar(source)
    return str(compiled.serialize_json())


class SeqGrammar:
    """One sequence's grammar: its compile, then its matcher (engine thread only)."""

    def __init__(self, compiled: Future[xgr.CompiledGrammar], label: str) -> None:
        self.compiled = compiled
        self.label = label
        self.matcher: xgr.GrammarMatcher | None = None

    @property
    def ready(self) -> bool:
        """Whether the compile is done (well or not): ``start`` will not block."""
        return self.compiled.done()

    def start(self, generated: list[int]) -> str | None:
        """Make the matcher and feed it the tokens the sequence has (a resumed
        job's); returns why it cannot run, or None."""
        try:
            self.matcher = xgr.GrammarMatcher(self.compiled.result())
        except GrammarRefused as exc:
            return str(exc)
        except Exception as exc:
            return f"{self.label} could not be compiled for this model: {exc}"
        for token_id in generated:
            if not self.matcher.accept_token(token_id):
                return f"the tokens logged for this job do not follow its {self.label}"
        return None

    def accept(self, token_id: int) -> bool:
        """Advance by the token drawn; False when the grammar does not allow it."""
        assert self.matcher is not None
        return bool(self.matcher.accept_token(token_id))

    @property
    def terminated(self) -> bool:
        return self.matcher is not None and bool(self.matcher.is_terminated())


def mask(logits: torch.Tensor, rows: list[int], grammars: list[SeqGrammar]) -> torch.Tensor:
    """``logits`` with every token the grammar of each of ``rows`` forbids at
    -inf (in place); the other rows are untouched."""
    # Rows of the bitmask are the logits' rows (xgrammar's indices address both).
    bitmask = xgr.allocate_token_bitmask(logits.shape[0], logits.shape[-1])
    for row, grammar in zip(rows, grammars, strict=True):
        assert grammar.matcher is not None
        grammar.matcher.fill_next_token_bitmask(bitmask, row)
    if logits.device.type != "cpu":
        bitmask = bitmask.to(logits.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(logits, bitmask, indices=rows)
    return logits
