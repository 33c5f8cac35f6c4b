"""Whether a structured output's spec compiles, asked at submit within a time
budget (``TOKENFLEET_GRAMMAR_COMPILE_S``), off the asker's thread.

The compile runs in a child process killed at the budget
(``tokenfleet.shared.budgeted``); the asker's thread only waits on a pipe, and
an event loop waits on a thread of this check's own (never the loop's default
executor, which other work shares). Each answer is kept by the spec's digest,
a refusal for the time included: a schema sent again is answered at once,
whatever it cost the first time. A process without xgrammar checks only a
regular expression's syntax, in-process (Python's ``re`` never expands a
repetition count, so that is quick).
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tokenfleet.shared import budgeted
from tokenfleet.shared.wire.structured import StructuredOutput, python_problem, source_problem

# Answers kept per process (a digest and a sentence each: a few hundred bytes).
ANSWERS_KEPT = 4096
BUDGET_SETTING = "TOKENFLEET_GRAMMAR_COMPILE_S"
# What a check found: None (it compiles), ("error", the compiler's sentence) or
# ("over", the budget it ran past).
Answer = tuple[str, str | float] | None


def over_budget(label: str, budget_s: float) -> str:
    """The sentence for a spec whose compile ran past the budget."""
    return (f"{label} took longer than {budget_s:g} s to compile, this fleet's limit "
            f"({BUDGET_SETTING}); a pattern's or an array's repetition counts each become "
            "grammar rules: use smaller counts, or check the length after generating")


class GrammarCheck:
    """One process's check of specs, with its answers kept."""

    def __init__(self, processes: int | None = None) -> None:
        # At most this many compiles at once (each a child on a core); more wait.
        self._processes = processes or max(2, os.cpu_count() or 2)
        self._slots = threading.BoundedSemaphore(self._processes)
        self._children = budgeted.Children()
        self._threads: ThreadPoolExecutor | None = None
        self._answers: OrderedDict[str, Answer] = OrderedDict()
        self._lock = threading.Lock()
        self._xgrammar = importlib.util.find_spec("xgrammar") is not None

    def known(self, spec: StructuredOutput) -> tuple[bool, str | None]:
        """``(True, problem)`` when ``spec`` was checked before, else ``(False, None)``."""
        key = spec.key()
        with self._lock:
            if key not in self._answers:
                return False, None
            self._answers.move_to_end(key)
            answer = self._answers[key]
        return True, _sentence(spec.label, answer)

    def problem(self, spec: StructuredOutput, budget_s: float) -> str | None:
        """Why ``spec`` cannot be used, naming it, or None; blocks this thread
        for at most the budget (plus a wait for a free slot)."""
        seen, problem = self.known(spec)
        if seen:
            return problem
        answer = self._compile(spec, budget_s)
        with self._lock:
            self._answers[spec.key()] = answer
            while len(self._answers) > ANSWERS_KEPT:
                self._answers.popitem(last=False)
        return _sentence(spec.label, answer)

    def _compile(self, spec: StructuredOutput, budget_s: float) -> Answer:
        how, source = spec.ebnf_or_source()
        if not self._xgrammar:
            error = python_problem(how, source)
            return None if error is None else ("error", error)
        with self._slots:
            try:
                error = self._children.run(_check, [how, source], budget_s)
            except budgeted.OverBudget:
                return ("over", budget_s)
            except budgeted.ChildFailed as exc:
                error = str(exc)
        return None if error is None else ("error", error)

    async def aproblem(self, spec: StructuredOutput, budget_s: float) -> str | None:
        """``problem`` for an event loop: a known answer at once, else on a
        thread of this check's own."""
        seen, problem = self.known(spec)
        if seen:
            return problem
        if self._threads is None:
            # One thread per slot: a thread only waits on its child.
            self._threads = ThreadPoolExecutor(max_workers=self._processes,
                                               thread_name_prefix="grammar-check")
        return await asyncio.get_running_loop().run_in_executor(
            self._threads, self.problem, spec, budget_s)

    def close(self) -> None:
        if self._threads is not None:
            self._threads.shutdown(wait=False, cancel_futures=True)
        self._children.close()


def _sentence(label: str, answer: Answer) -> str | None:
    # Kept without the label: the digest leaves a schema's name out.
    if answer is None:
        return None
    if answer[0] == "over":
        return over_budget(label, float(answer[1]))
    return f"{label} cannot be compiled: {answer[1]}"


def _check(ready: Any, how: str, source: str) -> str | None:
    # In the child: the import is setup (seconds, once per child), the compile is charged.
    import xgrammar  # noqa: F401
    ready()
    return source_problem(how, source)
