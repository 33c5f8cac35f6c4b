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


# --- Names a page gives in backticks exist in the code -------------------------------
#
# A span is taken as a name when it is one of:
# - a dotted path under the package (`tokenfleet.shared.settings`, `tokenfleet.X.f(a, b)`):
#   resolved by importing its longest module prefix and getting the rest as attributes, so a
#   module that moves is found where the page says it is, or the page is wrong;
# - a CamelCase name, alone or with attributes (`GenerationRequest`, `JobState.tenant`): it
#   must be a public name of some module of the package (attributes got from it), a Python
#   builtin, or one of the foreign names below (other projects' classes and Kubernetes kinds);
# - a gateway route (`/v1/...`, `/healthz`, `/readyz`, `/health`, `/version`, optionally
#   after its HTTP method):
#   it must be one of the app's routes, `{id}` matching any path parameter.
# `/metrics` is answered by a middleware (no route to read), so it is not checked here.

FOREIGN_NAMES = {
    "ValidationError",      # pydantic
    "SamplingParams",       # vLLM
    "MaxConnectionsError",  # redis-py
    "AuthenticationError", "NotFoundError",  # openai
    "LlamaForCausalLM", "DynamicCache", "AttentionInterface",  # transformers
    "DecodeStream",         # tokenizers
    "ScaledObject", "ServiceMonitor", "ReadWriteMany",  # KEDA, Prometheus operator, Kubernetes
    "Location", "Authorization", "Allow",  # HTTP headers
    "Dockerfile",
}
DOTTED = re.compile(r"tokenfleet(\.[A-Za-z_]\w*)+")
CAMEL = re.compile(r"[A-Z][A-Za-z0-9_]*[a-z][A-Za-z0-9_]*(\.[A-Za-z_]\w*)*")
ROUTE = re.compile(
    r"(?:(GET|POST|DELETE|PUT|PATCH) )?(/v1(?:/[^\s`]*)?|/healthz|/readyz|/health|/version)")
PAGES = [README, *sorted(DOCS.glob("*.md"))]


def spans(page: Path) -> list[str]:
    """Inline code spans of a page, fenced blocks left out."""
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.S | re.M)
    return re.findall(r"`([^`\n]+)`", text)


def resolve_dotted(path: str) -> object:
    """What a dotted path names: the longest importable module prefix, then attributes."""
    import importlib

    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: object = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)  # AttributeError: the page names nothing
        return obj
    raise ModuleNotFoundError(path)


def package_names() -> dict[str, list[object]]:
    """Every public module-level name of every module of the package: the classes and
    functions it defines (not those it imports from elsewhere), and its other values."""
    import importlib
    import pkgutil

    names: dict[str, list[object]] = {}
    for root in ("tokenfleet", "tokenfleet.shared", "tokenfleet.workers"):
        package = importlib.import_module(root)
        modules = [root] + [m.name for m in pkgutil.walk_packages(
            package.__path__, f"{root}.", onerror=lambda _: None)]
        for name in modules:
            try:
                module = importlib.import_module(name)
            except ImportError:  # an optional engine's library (vLLM) is not installed
                continue
            for attr, value in vars(module).items():
                home = getattr(value, "__module__", None)
                if attr.startswith("_") or (isinstance(home, str) and not home.startswith("tokenfleet")):
                    continue
                names.setdefault(attr, []).append(value)
    return names


def instance_attributes(obj: object) -> set[str]:
    """The attributes a class's methods set on ``self`` (an engine's ``vocab_size``)."""
    import inspect

    if not isinstance(obj, type):
        return set()
    found: set[str] = set()
    for cls in obj.__mro__:
        try:
            source = inspect.getsource(cls)
        except (OSError, TypeError):
            continue
        found.update(re.findall(r"self\.([A-Za-z_]\w*)\s*(?::[^=\n]*)?=", source))
    return found


def entry_point_groups() -> set[str]:
    """The entry-point groups the package declares: dotted names that are not modules."""
    return set(re.findall(r'^\[project\.entry-points\."([^"]+)"\]',
                          (ROOT / "pyproject.toml").read_text(), flags=re.M))


def has_path(obj: object, attrs: list[str]) -> bool:
    """Whether ``obj.a.b...`` exists; a pydantic field or an annotated attribute counts."""
    for attr in attrs:
        if hasattr(obj, attr):
            obj = getattr(obj, attr)
        elif attr in getattr(obj, "model_fields", {}) or attr in getattr(obj, "__annotations__", {}) \
                or attr in instance_attributes(obj):
            obj = None
        else:
            return False
    return True


def gateway_routes() -> set[tuple[str, str]]:
    from tokenfleet.gateway.app import create_app

    routes = set()
    for route in create_app().routes:
        path = re.sub(r"\{[^}]*\}", "{}", getattr(route, "path", ""))
        for method in getattr(route, "methods", None) or ():
            routes.add((method, path))
    return routes


def named_things() -> list[tuple[str, str]]:
    return [(page.name, span) for page in PAGES for span in spans(page)]


def test_every_name_a_page_gives_exists() -> None:
    import builtins

    names = package_names()
    routes = gateway_routes()
    groups = entry_point_groups()
    missing = []
    for page, span in named_things():
        span = span.strip()
        dotted = DOTTED.match(span)
        if span in groups:
            continue
        if dotted and (span == dotted.group(0) or span[dotted.end()] == "("):
            try:
                resolve_dotted(dotted.group(0))
            except (ImportError, AttributeError) as error:
                missing.append(f"{page}: `{span}` ({error})")
            continue
        if CAMEL.fullmatch(span.removesuffix("()")):
            head, *attrs = span.removesuffix("()").split(".")
            if head in FOREIGN_NAMES or hasattr(builtins, head):
                continue
            if head not in names:
                missing.append(f"{page}: `{span}` (no module of the package defines {head})")
                continue
            if not any(has_path(obj, attrs) for obj in names[head]):
                missing.append(f"{page}: `{span}` (no {head} of the package has it)")
            continue
        route = ROUTE.fullmatch(span)
        if route:
            method, path = route.group(1), re.sub(r"\{[^}]*\}", "{}", route.group(2).rstrip("/"))
            known = {p for _, p in routes}
            if path not in known or (method and (method, path) not in routes):
                missing.append(f"{page}: `{span}` (the gateway has no such route)")
    assert not missing, "pages name what the code does not have:\n" + "\n".join(missing)


def test_the_name_rule_catches_a_name_that_does_not_exist(tmp_path: Path) -> None:
    with pytest.raises(AttributeError):
        resolve_dotted("tokenfleet.shared.settings.NoSuchThing")
    assert "NoSuchClient" not in package_names()
    assert ("POST", "/v1/no-such-route") not in gateway_routes()


# --- The Redis layout page lists every key of Keys ------------------------------------

def test_the_redis_layout_page_lists_every_key() -> None:
    from tokenfleet.shared.wire.keys import Keys

    hook = load_hook("redis_layout")
    assert hook.MARKER in (DOCS / "redis-layout.md").read_text()
    assert "docs/hooks/redis_layout.py" in (ROOT / "mkdocs.yml").read_text()
    table = hook.render_table()
    keys = Keys("NS")
    # The keys the issue found missing, by the names the code gives them.
    assert f"`{keys.declared('MODEL').replace('NS', '<ns>').replace('MODEL', '<model>')}`" in table
    assert "`<ns>:refusals`" in table
    for member in hook.key_members():
        assert f"`Keys.{member}`" in table, f"Keys.{member} is not on the Redis layout page"


def test_a_key_without_a_description_fails_the_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    from tokenfleet.shared.wire.keys import Keys

    hook = load_hook("redis_layout")

    def undocumented(self: Keys, model: str) -> str:
        return f"{self.namespace}:new:{{{model}}}"

    monkeypatch.setattr(Keys, "undocumented", undocumented, raising=False)
    assert "undocumented" in hook.key_members()
    with pytest.raises(ValueError, match="Keys.undocumented"):
        hook.render_table()
