"""Structured output on the built-in engine: xgrammar grammars compiled off
the engine thread, a matcher per sequence, and the token mask of a step.

A spec (``StructuredOutput``) is compiled once per worker and cached by its
digest, on a small thread pool of its own: the engine thread only submits the
compile and, until it is done, leaves the sequence out of its batches, so
unconstrained jobs never wait on a schema. Each constrained sequence then
gets a matcher, fed every token it has (a resumed job's logged tokens first),
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

from tokenfleet.shared.structured import StructuredOutput

# Compiled grammars kept per worker; a schema used again after falling out
# is compiled again (milliseconds for the schemas apps send).
CACHE_SIZE = 256


class Grammars:
    """Compiles specs for one model's tokenizer, each once, on its own threads."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int],
                 threads: int = 1) -> None:
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="grammar")
        # Reading the vocabulary takes a while for a large one: off the caller's thread too.
        stops = sorted(stop_token_ids)
        self._compiler = self._executor.submit(
            lambda: xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(
                tokenizer, vocab_size=vocab_size, stop_token_ids=stops), cache_enabled=False))
        self._cache: OrderedDict[str, Future[xgr.CompiledGrammar]] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, spec: StructuredOutput) -> Future[xgr.CompiledGrammar]:
        """The compiled grammar of ``spec``, now or later: never blocks."""
        key = spec.key()
        with self._lock:
            found = self._cache.get(key)
            if found is not None and not (found.done() and found.exception() is not None):
                self._cache.move_to_end(key)
                return found
            future = self._executor.submit(self._compile, spec)
            self._cache[key] = future
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
            return future

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)

    def _compile(self, spec: StructuredOutput) -> xgr.CompiledGrammar:
        compiler = self._compiler.result()
        how, source = spec.ebnf_or_source()
        if how == "json":
            # Compact JSON: free whitespace lets a weak model pad forever.
            return compiler.compile_json_schema(source, any_whitespace=False)
        if how == "regex":
            return compiler.compile_regex(source)
        return compiler.compile_grammar(source)


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
