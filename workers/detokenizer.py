"""Incremental detokenization with stop strings.

Text is released only when it is final: a token that ends inside a UTF-8
sequence (or a merge the tokenizer resolves later) is held back until it
decodes cleanly (or, past ``HOLD_TOKENS``, up to what can no longer change),
and with stop strings the last ``len(longest stop) - 1``
characters wait until they cannot start a stop. So the concatenated deltas are
exactly the final text, whatever the subscriber saw first.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from tokenizers.decoders import DecodeStream

from tokenfleet.shared.compat.hf_transformers import rust_decoder

REPLACEMENT = "\ufffd"
# Tokens held back past this many, the text before the last REPLACEMENT is final
# and goes out: a character takes at most 4 bytes, so a longer wait is for bytes
# that will never decode (a model producing garbage would otherwise show nothing
# until its end). Byte-level BPE decodes lossily from the left, so that prefix
# never changes; with byte-fallback tokens (one byte each) a run held this long
# is invalid already, and every token of it stays a REPLACEMENT.
HOLD_TOKENS = 4
_rust: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def rust_tokenizer(tokenizer: Any) -> Any:
    """The ``tokenizers.Tokenizer`` behind ``tokenizer`` when decoding through it
    gives exactly ``tokenizer.decode``'s text; else None. (Asked once per tokenizer:
    every sequence a worker admits makes a stream.)"""
    try:
        return _rust[tokenizer]
    except (KeyError, TypeError):
        pass
    backend = rust_decoder(tokenizer)
    try:
        _rust[tokenizer] = backend
    except TypeError:  # not weakly referable: ask every time
        pass
    return backend


class TextStream:
    """Turns one sequence's generated token ids into text deltas.

    With a fast tokenizer each token is one call into Rust (``DecodeStream``,
    the same prefix/read-offset algorithm as below, some 10x cheaper than two
    ``tokenizer.decode`` calls from Python); other tokenizers take the Python
    path. The offsets here follow the Rust stream's, so either path can finish.
    """

    def __init__(self, tokenizer: Any, stop: list[str] | None = None, *,
                 include_stop: bool = False, skip_special_tokens: bool = True) -> None:
        """``include_stop``: a matched stop string stays at the text's end (vLLM's
        ``include_stop_str_in_output``); ``skip_special_tokens``: special tokens
        write no text (as every server's default)."""
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        # Decoding from a few tokens back (prefix) and subtracting what those
        # decode to keeps tokenizers that strip a leading space per call right.
        self._prefix_offset = 0
        self._read_offset = 0
        self._stop = stop or []
        self._include_stop = include_stop
        self._skip = skip_special_tokens
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self.text = ""  # every character decoded so far (cut at a stop string)
        self.emitted = 0  # how many characters of ``text`` were released
        self._early = 0  # characters of the held tokens' text already in ``text``
        self.stopped = False
        self._rust = rust_tokenizer(tokenizer)
        self._stream: Any = None if self._rust is None else DecodeStream(
            skip_special_tokens=skip_special_tokens)

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer

    def _decode(self, ids: list[int]) -> str:
        if self._rust is not None:
            return self._rust.decode(ids, skip_special_tokens=self._skip)  # type: ignore[no-any-return]
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)  # type: ignore[no-any-return]

    def push(self, token_id: int) -> str:
        """Add one token; return the text it releases (often all of it, maybe none)."""
        self._ids.append(token_id)
        if self._stream is not None:
            try:
                delta: str | None = self._stream.step(self._rust, token_id)
            except Exception:  # its prefix check failed: go on in Python from here
                self._stream = None
            else:
                if delta is None:
                    self._release_early()
                elif not self._stop and not self._early:
                    # The common case, once per token of most jobs: nothing
                    # held, nothing to look for, so the delta is all released
                    # (``_advance``, ``_append`` and ``_release`` in one).
                    self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
                    self.text += delta
                    self.emitted = len(self.text)
                    return delta
                else:
                    self._advance(delta)
                return self._release(final=False)
        decode: Callable[[list[int]], str] = self._decode
        before = decode(self._ids[self._prefix_offset:self._read_offset])
        after = decode(self._ids[self._prefix_offset:])
        if len(after) > len(before) and not after.endswith(REPLACEMENT):
            self._advance(after[len(before):])
        else:
            self._release_early(before, after)
        return self._release(final=False)

    def _release_early(self, before: str | None = None, after: str | None = None) -> None:
        """Held past ``HOLD_TOKENS``: add the held text up to its last REPLACEMENT."""
        if len(self._ids) - self._read_offset <= HOLD_TOKENS:
            return
        if before is None or after is None:
            before = self._decode(self._ids[self._prefix_offset:self._read_offset])
            after = self._decode(self._ids[self._prefix_offset:])
        held = after[len(before):]
        final = held[:held.rfind(REPLACEMENT)] if held.endswith(REPLACEMENT) else held
        if len(final) > self._early:
            self._append(final[self._early:])
            self._early = len(final)

    def _advance(self, delta: str) -> None:
        self._append(delta[self._early:])
        self._early = 0
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)

    def finish(self) -> str:
        """The sequence ended: release everything still held back."""
        if not self.stopped and self._read_offset < len(self._ids):
            before = self._decode(self._ids[self._prefix_offset:self._read_offset])
            after = self._decode(self._ids[self._prefix_offset:])
            self._append(after[len(before):][self._early:])
            self._early = 0
            self._read_offset = len(self._ids)
        return self._release(final=True)

    def _append(self, delta: str) -> None:
        if self.stopped:
            return
        if not self._stop:  # the common case, once per token: nothing to look for
            self.text += delta
            return
        start = max(0, len(self.text) - self._hold)
        self.text += delta
        hits = [(at, len(s)) for at, s in ((self.text.find(s, start), s) for s in self._stop)
                if at != -1]
        if hits:
            at, length = min(hits)  # the first to start (of two there, the shorter)
            self.text = self.text[: at + length if self._include_stop else at]
            self.stopped = True

    def _release(self, final: bool) -> str:
        end = len(self.text) if final or self.stopped else max(self.emitted, len(self.text) - self._hold)
        delta = self.text[self.emitted:end]
        self.emitted = end
        return delta
