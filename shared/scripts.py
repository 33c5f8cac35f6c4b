"""The fleet's Lua scripts, kept as ``.lua`` files and registered once per client.

Each script makes one multi-key change atomic (admission, ownership, the final
write before the acknowledgement); see the comment at the top of each file.
"""

from __future__ import annotations

from functools import cache
from importlib import resources
from typing import Any

NAMES = ("submit", "cancel", "start", "emit", "finish", "requeue", "expire", "forget_queue")


@cache
def source(name: str) -> str:
    return resources.files("tokenfleet.shared").joinpath(f"lua/{name}.lua").read_text(encoding="utf-8")


class Scripts:
    """Registered scripts of one client (sync or asyncio): ``scripts.submit(keys, args)``.

    redis-py's Script objects run EVALSHA and fall back to loading the script
    once when the server does not know it (after a restart, say).
    """

    def __init__(self, client: Any) -> None:
        for name in NAMES:
            setattr(self, name, client.register_script(source(name)))

    submit: Any
    cancel: Any
    start: Any
    emit: Any
    finish: Any
    requeue: Any
    expire: Any
    forget_queue: Any
