"""The name a worker serves its model under unless told another: the queue
clients pass as ``model=``.

As vLLM serves a model under the name it was given (``--served-model-name``
says otherwise), a worker's queue is its model's name: ``tiny`` for the
built-in model, a directory's base name (``/models/llama-3-8b/`` serves
``llama-3-8b``), and a Hub id's name (``hf:Qwen/Qwen2.5-0.5B`` serves
``Qwen2.5-0.5B``). A Hub id keeps only its name because a queue name has no
'/': it is part of every job id, which is part of URL paths (``/v1/jobs/{id}``).
"""

from __future__ import annotations

from pathlib import PurePosixPath

from tokenfleet.shared.wire.keys import QUEUE_NAME_RULE, is_queue_name


def served_name(model: str) -> str:
    """The queue a worker of ``model`` serves when none is named; ValueError
    when that name is no queue name, saying how to name one."""
    name = PurePosixPath(model.removeprefix("hf:").rstrip("/") or model).name
    if not is_queue_name(name):
        raise ValueError(f"a worker's queue is its model's name unless named, and {name!r} "
                         f"(of model {model!r}) is not a queue name ({QUEUE_NAME_RULE}): name "
                         "one with --queue NAME or TOKENFLEET_QUEUE")
    return name
