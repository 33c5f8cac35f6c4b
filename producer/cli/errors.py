"""The fleet's refusals as the command line says them: each names the option
that changes the outcome (``--queue-ahead``), not the Python parameter or the
request field behind it (``require_worker=False``, ``sampling.max_new_tokens``)."""

from __future__ import annotations

import re

from tokenfleet.shared.wire.errors import NoWorker, TokenfleetError

# A request field, as a refusal names it, and the option (of `tokenfleet submit`, `batch
# submit`) that sets it.
FLAGS = {"sampling.max_new_tokens": "--max-new-tokens", "sampling.temperature": "--temperature",
         "sampling.top_p": "--top-p", "sampling.top_k": "--top-k", "sampling.seed": "--seed",
         "sampling.stop": "--stop", "model": "--model", "priority": "--priority",
         "prompt": "PROMPT", "completion_window": "--completion-window",
         "endpoint": "--endpoint"}
# The same fields named bare in a limit's sentence ("max_new_tokens is 5000, ...").
BARE = {"max_new_tokens": "--max-new-tokens"}


def said(exc: TokenfleetError) -> str:
    """``exc``'s sentence, its fields and parameters named as the command line's options."""
    if isinstance(exc, NoWorker):
        now = ", ".join(repr(q) for q in exc.served) or "none"
        return (f"no live worker serves queue {exc.queue!r} (queues served now: {now}); nothing "
                f"was enqueued: start one with `tokenfleet worker --queue {exc.queue}`, declare "
                f"it for a pool that scales to zero (`tokenfleet queue create {exc.queue}`), or "
                "pass --queue-ahead to queue ahead of the workers")
    text = str(exc)
    for field, flag in FLAGS.items():
        text = text.replace(f"'{field}'", flag)
    for name, flag in BARE.items():
        text = re.sub(rf"(?<![\w.-]){name}\b", flag, text)
    return text
