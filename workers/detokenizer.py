"""Incremental detokenization with stop strings.

Text is released only when it is final: a token that ends inside a UTF-8
sequence (or a merge the tokenizer resolves later) is held back until it
decodes cleanly, and with stop strings the last ``len(longest stop) - 1``
characters wait until they cannot start a stop. So the concatenated deltas are
exactly the final text, whatever the subscriber saw first.
"""

from __future__ import annotations

from typing import Any

REPLACEMENT = "\ufffd"


class TextStream:
    """Turns one sequence's generated token ids into text deltas."""

    def __init__(self, tokenizer: Any, stop: list[str] | None = None) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        # Decoding from a few tokens back (prefix) and subtracting what those
        # decode to keeps tokenizers that strip a leading space per call right.
        self._prefix_offset = 0
        self._read_offset = 0
        self._stop = stop or []
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self.text = ""  # every character decoded so far (cut at a stop string)
        self.emitted = 0  # how many characters of ``text`` were released
        self.stopped = False

    def push(self, token_id: int) -> str:
        """Add one token; return the text it releases (often all of it, maybe none)."""
        self._ids.append(token_id)
        decode = self._tokenizer.decode
        window = self._ids[self._prefix_offset:]
        before = decode(self._ids[self._prefix_offset:self._read_offset], skip_special_tokens=True)
        after = decode(window, skip_special_tokens=True)
        if len(after) > len(before) and not after.endswith(REPLACEMENT):
            self._append(after[len(before):])
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return self._release(final=False)

    def finish(self) -> str:
        """The sequence ended: release everything still held back."""
        if not self.stopped and self._read_offset < len(self._ids):
            decode = self._tokenizer.decode
            before = decode(self._ids[self._prefix_offset:self._read_offset],
                            skip_special_tokens=True)
            after = decode(self._ids[self._prefix_offset:], skip_special_tokens=True)
            self._append(after[len(before):])
            self._read_offset = len(self._ids)
        return self._release(final=True)

    def _append(self, delta: str) -> None:
        if self.stopped:
            return
        start = max(0, len(self.text) - self._hold)
        self.text += delta
        hits = [at for at in (self.text.find(s, start) for s in self._stop) if at != -1]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True

    def _release(self, final: bool) -> str:
        end = len(self.text) if final or self.stopped else max(self.emitted, len(self.text) - self._hold)
        delta = self.text[self.emitted:end]
        self.emitted = end
        return delta
