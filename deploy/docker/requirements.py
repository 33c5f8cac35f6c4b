"""Print the requirements of tokenfleet and the named extras, one a line.

The image installs its dependencies from these lines before the source is
copied in, so that a change to the code rebuilds one small layer instead of
reinstalling torch. It reads ``pyproject.toml`` only (no build backend, no
network): ``python requirements.py pyproject.toml worker gateway``. An extra
that names another (``tokenfleet[worker]``) is followed.
"""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

SELF = re.compile(r"tokenfleet\[(?P<extras>[^\]]+)\]")


def requirements(project: dict, extras: list[str]) -> list[str]:  # type: ignore[type-arg]
    optional = project.get("optional-dependencies", {})
    lines: list[str] = list(project.get("dependencies", []))
    todo, seen = list(extras), set()
    while todo:
        extra = todo.pop()
        if extra in seen:
            continue
        if extra not in optional:
            raise SystemExit(f"no extra {extra!r} in pyproject.toml: one of {sorted(optional)}")
        seen.add(extra)
        for line in optional[extra]:
            named = SELF.fullmatch(line.strip())
            if named:
                todo.extend(name.strip() for name in named["extras"].split(","))
            else:
                lines.append(line)
    return list(dict.fromkeys(lines))  # one line each, first order kept


def main(argv: list[str]) -> None:
    if not argv:
        raise SystemExit("usage: requirements.py PYPROJECT [EXTRA ...]")
    project = tomllib.loads(Path(argv[0]).read_text())["project"]
    print("\n".join(requirements(project, argv[1:])))


if __name__ == "__main__":
    main(sys.argv[1:])
