"""Streamed text is final text: nothing half-decoded, nothing past a stop string."""

from __future__ import annotations

import pytest

from tokenfleet.shared.tiny import byte_level_tokenizer
from tokenfleet.workers.detokenizer import TextStream


@pytest.fixture(scope="module")
def tok():  # type: ignore[no-untyped-def]
    return byte_level_tokenizer()


def stream(tok, text: str, stop: list[str] | None = None) -> tuple[list[str], TextStream]:  # type: ignore[no-untyped-def]
    ts = TextStream(tok, stop)
    deltas = []
    for token_id in tok(text, add_special_tokens=False)["input_ids"]:
        deltas.append(ts.push(token_id))
        if ts.stopped:
            break
    deltas.append(ts.finish())
    return deltas, ts


def test_multibyte_characters_are_held_until_complete(tok) -> None:  # type: ignore[no-untyped-def]
    text = "naïve café → 🙂 done"
    deltas, ts = stream(tok, text)
    assert "".join(deltas) == text == ts.text
    assert not any("\ufffd" in d for d in deltas)
    # The 4-byte emoji arrives as four tokens: three of them release nothing.
    assert deltas.count("") >= 3


def test_a_stop_string_cuts_the_text_and_nothing_after_it_is_streamed(tok) -> None:  # type: ignore[no-untyped-def]
    deltas, ts = stream(tok, "alpha beta STOP gamma", stop=["STOP"])
    assert ts.stopped and ts.text == "alpha beta "
    assert "".join(deltas) == "alpha beta "


def test_text_that_could_start_a_stop_string_waits(tok) -> None:  # type: ignore[no-untyped-def]
    ts = TextStream(tok, ["END"])
    released = "".join(ts.push(t) for t in tok("abcE", add_special_tokens=False)["input_ids"])
    assert released == "ab"  # "cE" may still become "END"...
    released += "".join(ts.push(t) for t in tok("x", add_special_tokens=False)["input_ids"])
    assert released + ts.finish() == "abcEx"  # ...it did not


def test_special_tokens_add_no_text(tok) -> None:  # type: ignore[no-untyped-def]
    ts = TextStream(tok)
    assert ts.push(tok.eos_token_id) == "" and ts.finish() == ""


def test_special_tokens_are_written_when_not_skipped(tok) -> None:  # type: ignore[no-untyped-def]
    # vLLM's skip_special_tokens=false: the model's markers are part of the text.
    ts = TextStream(tok, skip_special_tokens=False)
    for token_id in [*tok("hi", add_special_tokens=False)["input_ids"], tok.eos_token_id]:
        ts.push(token_id)
    ts.finish()
    assert ts.text == "hi" + tok.eos_token


@pytest.mark.parametrize("stop", [["STOP"], ["STOP", "ST"], ["OP", "STOP"]])
def test_a_stop_string_kept_in_the_output_ends_the_text(tok, stop: list[str]) -> None:  # type: ignore[no-untyped-def]
    # vLLM's include_stop_str_in_output: the first stop string to start is kept (of
    # two that start there, the shorter), and nothing after it.
    ts = TextStream(tok, stop, include_stop=True)
    deltas = [ts.push(t) for t in tok("alpha beta STOP gamma", add_special_tokens=False)["input_ids"]]
    deltas.append(ts.finish())
    kept = "alpha beta ST" if "ST" in stop else "alpha beta STOP"
    assert ts.stopped and ts.text == kept == "".join(deltas)


@pytest.mark.parametrize("path", ["rust", "python"])
def test_bytes_that_never_decode_are_released_as_they_come_not_at_the_end(  # type: ignore[no-untyped-def]
        tok, path: str) -> None:
    """A model producing invalid UTF-8 (random weights, a broken fine-tune) shows
    its replacement characters as it goes, not all at once when it ends."""
    continuation = tok("é", add_special_tokens=False)["input_ids"][1]
    ids = [continuation] * 24 + tok(" then ok 🙂", add_special_tokens=False)["input_ids"]
    ts = TextStream(tok)
    if path == "python":
        ts._stream = None  # the path of tokenizers without a Rust decode stream
    deltas = [ts.push(t) for t in ids]
    deltas.append(ts.finish())
    first = next(i for i, d in enumerate(deltas) if d)
    assert first <= 5, f"the first text came after token {first + 1}"
    assert "".join(deltas) == ts.text == tok.decode(ids)


def test_a_character_split_across_tokens_after_garbage_still_decodes(tok) -> None:  # type: ignore[no-untyped-def]
    lead, continuation = tok("é", add_special_tokens=False)["input_ids"]
    ids = [continuation] * 6 + [lead, continuation] + [continuation] * 6 + [lead, continuation]
    ts = TextStream(tok)
    deltas = [ts.push(t) for t in ids] + [ts.finish()]
    assert "".join(deltas) == tok.decode(ids)
    assert "é" in "".join(deltas)
