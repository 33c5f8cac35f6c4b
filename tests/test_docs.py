"""The documentation keeps up with the code: every setting documented, the README a
front page whose links lead somewhere and whose test command is the one CI runs."""

from __future__ import annotations

import importlib.util
import re
import unicodedata
from pathlib import Path
from types import ModuleType

import pytest

from tokenfleet.shared.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"


def load_hook(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"docs_hook_{name}", DOCS / "hooks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("field", sorted(Settings.model_fields))
def test_every_setting_has_a_description(field: str) -> None:
    description = Settings.model_fields[field].description
    assert description and description.strip(), (
        f"Settings.{field} has no description: add Field(description=...) in shared/settings.py")


def test_the_settings_page_lists_every_setting() -> None:
    hook = load_hook("settings")
    page = (DOCS / "settings.md").read_text()
    assert hook.MARKER in page
    table = hook.render_table()
    rows = [line for line in table.splitlines() if line.startswith("| `TOKENFLEET_")]
    assert len(rows) == len(Settings.model_fields)
    for field in Settings.model_fields:
        assert f"| `TOKENFLEET_{field.upper()}` |" in table
    assert "docs/hooks/settings.py" in (ROOT / "mkdocs.yml").read_text()


def test_the_settings_page_says_which_process_reads_each_setting() -> None:
    table = load_hook("settings").render_table()
    assert "| `TOKENFLEET_MODEL` | worker |" in table
    assert "| `TOKENFLEET_HEADER_TIMEOUT_S` | gateway |" in table
    assert "| `TOKENFLEET_REQUIRE_WORKER` | client, gateway |" in table
    for limit in ("MAX_QUEUE", "MAX_PROMPT_TOKENS", "MAX_NEW_TOKENS_LIMIT", "MAX_PAYLOAD_BYTES"):
        assert f"| `TOKENFLEET_{limit}` | worker (published to clients) |" in table


def test_readme_is_a_front_page() -> None:
    assert len(README.read_text().splitlines()) < 250


def test_readme_runs_the_test_command_ci_runs() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    command = next(line for line in ci.splitlines()
                   if line.startswith("python3 -m venv") and "pytest" in line)
    readme_command = command.removesuffix(" || exit 1")
    assert readme_command in README.read_text().splitlines()


def slug(heading: str) -> str:
    """The anchor MkDocs gives a heading (Python-Markdown's toc slugify)."""
    text = unicodedata.normalize("NFKD", heading).encode("ascii", "ignore").decode()
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def test_readme_links_lead_to_pages_and_headings() -> None:
    links = re.findall(r"\]\(([^)#\s]+)(?:#([^)]*))?\)", README.read_text())
    local = [(path, anchor) for path, anchor in links if not re.match(r"[a-z]+:", path)]
    assert local, "the README links into docs/"
    for path, anchor in local:
        target = ROOT / path
        assert target.exists(), f"README links to {path}, which does not exist"
        if anchor:
            headings = re.findall(r"^#+ (.+)$", target.read_text(), re.MULTILINE)
            assert anchor in {slug(h) for h in headings}, f"README links to {path}#{anchor}: no such heading"


def test_docs_speak_of_the_project_not_of_how_it_was_built() -> None:
    pattern = re.compile(r"\bissue \d|\bsessions?\b|\bthis task\b", re.IGNORECASE)
    for path in [README, *DOCS.glob("*.md")]:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            assert not pattern.search(line), f"{path.name}:{number}: {line}"
