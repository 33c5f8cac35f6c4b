"""The fleet's Lua scripts, kept as ``.lua`` files and registered once per client.

Each script makes one multi-key change atomic (admission, ownership, the final
write before the acknowledgement); see the comment at the top of each file.
"""

from __future__ import annotations

import re
from functools import cache
from importlib import resources
from typing import Any

NAMES = ("submit", "cancel", "start", "emit", "finish", "requeue", "resume", "expire",
         "forget_queue")

# A line '-- include: NAME.lua' is replaced by that fragment (Lua has no
# require in Redis): a rule several scripts share is written once.
_INCLUDE = re.compile(r"^-- include: ([a-z_]+)\.lua$", re.MULTILINE)


def _read(filename: str) -> str:
    return resources.files("tokenfleet.shared").joinpath(f"lua/{filename}").read_text(encoding="utf-8")


@cache
def source(name: str) -> str:
    return _INCLUDE.sub(lambda m: _read(f"{m.group(1)}.lua"), _read(f"{name}.lua"))


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
    resume: Any
    expire: Any
    forget_queue: Any
