"""The built-in engine's structured output on the tiny model, without Redis:
compiles off the engine thread, the mask per row, resume from a token log."""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tokenfleet.shared.wire.schemas import FinishReason, SamplingParams
from tokenfleet.shared.wire.structured import StructuredOutput
from tokenfleet.workers.build import grammars
from tokenfleet.workers.detokenizer import TextStream
from tokenfleet.workers.grammar import Grammars
from tokenfleet.workers.hf_engine import HFEngine
from tokenfleet.workers.runner import HFRunner
from tokenfleet.workers.scheduler import Scheduler
from tokenfleet.workers.sequence import Sequence
from tokenfleet.workers.output_processor import step

pytestmark = pytest.mark.timeout(120)

SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                           "n": {"type": "integer", "minimum": 0,
                                                 "maximum": 99}},
          "required": ["ok", "n"], "additionalProperties": False}
SPEC = StructuredOutput(kind="json_schema", name="flag", json_schema=SCHEMA)


@pytest.fixture(scope="module")
def runner(loaded_tiny: Any) -> HFRunner:
    model, tokenizer = loaded_tiny
    return HFRunner(model, tokenizer)


@pytest.fixture
def engine(runner: HFRunner, loaded_tiny: Any) -> Iterator[HFEngine]:
    _, tokenizer = loaded_tiny
    built = HFEngine(Scheduler(8, runner.eos_token_ids, runner.max_model_len), runner)
    built.grammars = grammars(tokenizer, runner.vocab_size, runner.eos_token_ids)
    yield built
    assert built.grammars is not None
    built.grammars.close()


def seq(tokenizer: Any, job_id: str, structured: StructuredOutput | None = None,
        max_new_tokens: int = 40, seed: int | None = None) -> Sequence:
    return Sequence(job_id, tokenizer("Once upon a time")["input_ids"],
                    SamplingParams(max_new_tokens=max_new_tokens, temperature=1.0 if seed
                                   is not None else 0.0, seed=seed),
                    TextStream(tokenizer), structured=structured)


def run(engine: HFEngine, seqs: list[Sequence]) -> dict[str, str]:
    for s in seqs:
        engine.add(s)
    texts: dict[str, str] = {}
    while engine.has_work:
        for out in step(engine):
            texts[out.seq.job_id] = texts.get(out.seq.job_id, "") + out.text
    return texts


def test_a_worker_without_xgrammar_refuses_a_constrained_job_naming_the_extra(
        runner: HFRunner, loaded_tiny: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    # The worker extra leaves xgrammar out (the structured extra has it): such
    # a worker still serves every other job.
    _, tokenizer = loaded_tiny
    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import xgrammar: ImportError
    monkeypatch.delitem(sys.modules, "tokenfleet.workers.grammar")
    engine = HFEngine(Scheduler(8, runner.eos_token_ids, runner.max_model_len), runner)
    engine.grammars = grammars(tokenizer, runner.vocab_size, runner.eos_token_ids)
    assert engine.grammars is None
    why = engine.refusal(seq(tokenizer, "constrained", SPEC))
    assert why is not None and why.startswith(
        f"this worker cannot constrain output to a {SPEC.label}: structured output needs "
        'xgrammar (pip install "tokenfleet[structured]"'), why
    assert engine.refusal(seq(tokenizer, "plain")) is None
    assert run(engine, [seq(tokenizer, "plain", max_new_tokens=4)])["plain"]


def test_constrained_rows_follow_the_schema_and_unconstrained_rows_are_untouched(
    engine: HFEngine, loaded_tiny: Any
) -> None:
    _, tok = loaded_tiny
    alone = run(engine, [seq(tok, "plain", max_new_tokens=8)])["plain"]
    seqs = [seq(tok, "plain", max_new_tokens=8),
            *(seq(tok, f"json{i}", SPEC, seed=i) for i in range(2))]
    texts = run(engine, seqs)
    assert texts["plain"] == alone  # greedy, in a batch with masked rows: the same tokens
    for s in seqs[1:]:
        assert s.finish_reason is FinishReason.EOS  # the grammar ended: only EOS was left
        value = json.loads(texts[s.job_id])
        assert set(value) == {"ok", "n"} and isinstance(value["ok"], bool)
        assert 0 <= value["n"] <= 99


def test_an_unconstrained_job_runs_while_a_schema_compiles_and_the_other_waits(
    engine: HFEngine, loaded_tiny: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, tok = loaded_tiny
    release = threading.Event()
    compile_ = Grammars._compile

    def slow(self: Grammars, key: str, spec: StructuredOutput) -> Any:
        assert release.wait(30), "the test never released the compile"
        return compile_(self, key, spec)

    monkeypatch.setattr(Grammars, "_compile", slow)
    constrained, plain = seq(tok, "json", SPEC, seed=1), seq(tok, "plain", max_new_tokens=4)
    engine.add(constrained)
    engine.add(plain)
    texts: dict[str, str] = {}
    while plain.finish_reason is None:
        for out in step(engine):
            texts[out.seq.job_id] = texts.get(out.seq.job_id, "") + out.text
    # Every token of the plain job came while the schema was still compiling.
    assert len(plain.generated) == 4 and constrained.generated == []
    release.set()
    texts.update(run(engine, []))
    assert constrained.finish_reason is FinishReason.EOS
    assert set(json.loads(texts["json"])) == {"ok", "n"}


def test_a_resumed_job_replays_its_logged_tokens_into_the_grammar(
    engine: HFEngine, loaded_tiny: Any
) -> None:
    _, tok = loaded_tiny
    first = seq(tok, "first", SPEC, seed=7)
    run(engine, [first])
    logged = first.generated[:5]  # the tokens its first worker stored before it died
    resumed = seq(tok, "resumed", SPEC, seed=7)
    resumed.restore(logged)
    run(engine, [resumed])
    assert resumed.generated[:5] == logged
    assert resumed.generated == first.generated  # seeded: the same draws from there on
    json.loads(tok.decode(resumed.generated, skip_special_tokens=True))


def test_a_log_the_grammar_cannot_take_fails_the_job_alone(
    engine: HFEngine, loaded_tiny: Any
) -> None:
    _, tok = loaded_tiny
    broken = seq(tok, "broken", SPEC)
    broken.restore(tok("not json")["input_ids"])
    plain = seq(tok, "plain", max_new_tokens=4)
    run(engine, [broken, plain])
    assert broken.finish_reason is FinishReason.ERROR
    assert "do not follow its json_schema 'flag'" in str(broken.error)
    assert plain.finish_reason is FinishReason.LENGTH


def test_the_mask_leaves_only_what_the_grammar_allows(engine: HFEngine, loaded_tiny: Any
                                                      ) -> None:
    from tokenfleet.workers.grammar import SeqGrammar, mask

    _, tok = loaded_tiny
    assert engine.grammars is not None
    grammar = SeqGrammar(engine.grammars.compile(StructuredOutput(kind="choice",
                                                                  choice=["yes", "no"])),
                         "choice")
    assert grammar.start([]) is None
    logits = torch.zeros(2, engine.runner.vocab_size)  # type: ignore[attr-defined]
    mask(logits, [1], [grammar])
    allowed = [t for t in range(logits.shape[1]) if logits[1, t] != float("-inf")]
    assert allowed and all("yes".startswith(tok.decode([t])) or "no".startswith(tok.decode([t]))
                           for t in allowed)
    assert bool((logits[0] == 0).all())  # the row that asks nothing keeps every token


def test_the_grammar_cache_is_bounded_in_bytes_and_a_larger_grammar_is_refused(
    runner: HFRunner, loaded_tiny: Any
) -> None:
    from tokenfleet.workers.grammar import GrammarRefused

    _, tokenizer = loaded_tiny
    bound = 10_000  # a few of the tiny vocabulary's grammars (about 3 KB each)
    kept = Grammars(tokenizer, runner.vocab_size, runner.eos_token_ids, budget_s=60,
                    cache_bytes=bound)
    tight = Grammars(tokenizer, runner.vocab_size, runner.eos_token_ids, budget_s=60,
                     cache_bytes=100)
    try:
        for i in range(8):
            spec = StructuredOutput(kind="json_schema", json_schema={"enum": [i, "x" * i]})
            assert kept.compile(spec).result(timeout=60) is not None
            assert 0 < kept.cached_bytes <= bound
        with pytest.raises(GrammarRefused, match="above this worker's limit of .* MiB "
                                                 r"\(TOKENFLEET_GRAMMAR_CACHE_MB\)"):
            tight.compile(SPEC).result(timeout=60)
    finally:
        kept.close()
        tight.close()
