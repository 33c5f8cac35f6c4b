"""The Dockerfile's stages as the tests read them: instructions in order,
continuation lines joined, comments left out."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "Dockerfile"


@dataclass
class Stage:
    name: str
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)  # (INSTRUCTION, rest)

    def all(self, instruction: str) -> list[str]:
        return [rest for name, rest in self.instructions if name == instruction]

    def last(self, instruction: str) -> str | None:
        found = self.all(instruction)
        return found[-1] if found else None

    def exec_form(self, instruction: str) -> list[str]:
        """The JSON list of the stage's last ENTRYPOINT or CMD."""
        rest = self.last(instruction)
        assert rest is not None, f"stage {self.name} has no {instruction}"
        return json.loads(rest)  # type: ignore[no-any-return]


def stages(path: Path = DOCKERFILE) -> dict[str, Stage]:
    text = re.sub(r"\\\n", " ", path.read_text())
    found: dict[str, Stage] = {}
    current: Stage | None = None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        instruction, _, rest = line.partition(" ")
        instruction = instruction.upper()
        if instruction == "FROM":
            base, _, name = rest.partition(" AS ")
            current = found.setdefault(name.strip(), Stage(name.strip(), base.strip()))
        elif current is not None:
            current.instructions.append((instruction, rest.strip()))
    return found
