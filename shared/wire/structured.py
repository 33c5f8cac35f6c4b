"""Structured output: the one normalized spec a job carries when its text must
follow a JSON schema, any JSON object, a regular expression, a list of choices
or an EBNF grammar, and the check that it compiles.

Every way a caller asks for it (OpenAI's ``response_format``, vLLM's
``structured_outputs``, a tool call, ``submit(json_schema=...)``) becomes a
``StructuredOutput``; engines see nothing else. The model checks the spec's
shape and size only: compiling it can take seconds (``grammar_check`` does
that at submit, off the caller's thread, within a budget). A process without
xgrammar (the bare client install: xgrammar needs torch) checks only a regular
expression's syntax, and the worker, which always has it, fails what does not
compile with the same sentence.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, model_validator

# What a spec may weigh, as JSON: a schema is small; a book is a mistake.
MAX_SPEC_BYTES = 64 * 1024
MAX_CHOICES = 256

Kind = Literal["json_object", "json_schema", "regex", "choice", "grammar"]


class StructuredOutput(BaseModel):
    """What the generated text must be; ``kind`` names the one field that says how.

    - ``json_object``: any JSON object (OpenAI's JSON mode);
    - ``json_schema``: JSON valid against ``json_schema`` (``name`` is the
      caller's name for it, used in errors);
    - ``regex``: text matching ``regex`` in full;
    - ``choice``: exactly one of ``choice``;
    - ``grammar``: text of the EBNF (GBNF) ``grammar``, whose start rule is ``root``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Kind
    name: str | None = None
    json_schema: dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    @model_validator(mode="after")
    def _one_spec(self) -> StructuredOutput:
        given = {k for k in ("json_schema", "regex", "choice", "grammar")
                 if getattr(self, k) is not None}
        wanted = set() if self.kind == "json_object" else {self.kind}
        if given != wanted:
            need = f"the field {self.kind}" if wanted else "no other field"
            raise ValueError(f"structured output of kind {self.kind!r} takes {need}, "
                             f"not {', '.join(sorted(given)) or 'nothing'}")
        size = len(orjson.dumps(self.model_dump(exclude_none=True)))
        if size > MAX_SPEC_BYTES:
            raise ValueError(f"structured output spec is {size} bytes as JSON, above the "
                             f"limit of {MAX_SPEC_BYTES}")
        if self.choice is not None and not 1 <= len(self.choice) <= MAX_CHOICES:
            raise ValueError(f"choice must list 1 to {MAX_CHOICES} strings, not {len(self.choice)}")
        return self

    @property
    def label(self) -> str:
        """How an error names this spec: the schema by its name."""
        if self.kind == "json_schema" and self.name:
            return f"json_schema {self.name!r}"
        return self.kind

    def key(self) -> str:
        """A digest of the spec: what a compiled grammar is cached by."""
        canonical = orjson.dumps(self.model_dump(exclude={"name"}), option=orjson.OPT_SORT_KEYS)
        return hashlib.sha256(canonical).hexdigest()

    def ebnf_or_source(self) -> tuple[str, str]:
        """``(how, source)`` for xgrammar: ``json`` with a schema's text, ``regex``,
        or ``ebnf`` (a list of choices is a grammar of alternatives)."""
        if self.kind == "json_object":
            return "json", '{"type": "object"}'
        if self.kind == "json_schema":
            return "json", orjson.dumps(self.json_schema).decode()
        if self.kind == "regex":
            return "regex", str(self.regex)
        if self.kind == "choice":
            return "ebnf", "root ::= " + " | ".join(
                orjson.dumps(c).decode() for c in self.choice or [])
        return "ebnf", str(self.grammar)


def source_problem(how: str, source: str) -> str | None:
    """Why ``source`` (of ``ebnf_or_source``) cannot be compiled, or None, by
    xgrammar's own compiler (no tokenizer needed); without xgrammar, what
    ``python_problem`` finds. It can take long: ``tokenfleet.shared.grammar_check``
    runs it in a child process, within a budget."""
    try:
        import xgrammar
    except ImportError:
        return python_problem(how, source)
    try:
        if how == "json":
            xgrammar.Grammar.from_json_schema(source)
        elif how == "regex":
            xgrammar.Grammar.from_regex(source)
        else:
            xgrammar.Grammar.from_ebnf(source)
    except Exception as exc:  # xgrammar raises RuntimeError with its parser's message
        return first_line(exc)
    return None


def python_problem(how: str, source: str) -> str | None:
    """What Python alone can tell, quickly: a regular expression that does not
    parse (``re`` never expands a repetition count)."""
    if how == "regex":
        try:
            re.compile(source)
        except re.error as exc:
            return str(exc)
    return None


def first_line(exc: Exception) -> str:
    # xgrammar's message starts with "[time] file.cc:line: ": the reason is after it.
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", text)[:300]


def from_response_format(value: Any) -> StructuredOutput | None:
    """OpenAI's ``response_format`` as a spec: None for ``{"type": "text"}``
    (or None); ``ValueError`` naming what is wrong otherwise."""
    if value is None:
        return None
    if isinstance(value, StructuredOutput):
        return value
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput(kind="json_object")
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise ValueError("response_format of type 'json_schema' needs json_schema.schema, "
                             "a JSON schema object")
        unknown = set(spec) - {"name", "schema", "strict", "description"}
        if unknown:
            raise ValueError(f"response_format.json_schema has unknown field(s) "
                             f"{', '.join(sorted(unknown))}: name, schema, strict, description")
        # strict: the output always follows the schema here, strict or not.
        return StructuredOutput(kind="json_schema", name=spec.get("name"),
                                json_schema=spec["schema"])
    named = f"type {kind[:40]!r}" if isinstance(kind, str) else "without a type"
    raise ValueError(f"response_format {named} is not supported: 'text', 'json_object' or "
                     "'json_schema'")
