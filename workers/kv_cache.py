"""The running batch's KV cache, kept in preallocated buffers.

transformers' ``DynamicCache`` concatenates every layer's keys and values at
each decode step, and the batch operations (drop a row, add rows) copy the
whole cache again: a cost that grows with the batch at every step.
Here each layer owns buffers ``[rows, heads, columns, head_dim]`` with room to
spare, and:

- a decode step writes one column in place;
- a sequence that leaves has its row filled by the last row (one row copied);
- new sequences are written into free rows, right-aligned with the others
  (rows are left-padded to a common length; the attention mask hides padding);
- columns on the left that no row uses any more are dropped only when they
  are a large share of the width, since dropping them moves everything.

Row order is the cache's own, not the scheduler's: the runner keeps the job id
of each row. Buffers start zeroed and padding only ever holds finite values
(zeros or an earlier row's), so masked positions cannot turn into NaN.
"""

from __future__ import annotations

from typing import Any

import torch

from tokenfleet.shared.compat.hf_transformers import CacheLayer, LayerCache


class SlotLayer(CacheLayer):
    """One layer's keys and values; ``keys``/``values`` are views of the live part."""

    def __init__(self) -> None:
        super().__init__()
        self.k: torch.Tensor | None = None
        self.v: torch.Tensor | None = None
        self.rows = 0
        self.width = 0

    @property
    def keys(self) -> torch.Tensor | None:
        return None if self.k is None else self.k[:self.rows, :, :self.width]

    @keys.setter
    def keys(self, value: Any) -> None:  # DynamicLayer.__init__/reset assign None
        if value is not None:
            raise AttributeError("SlotLayer keys are written through update() and the batch ops")

    @property
    def values(self) -> torch.Tensor | None:
        return None if self.v is None else self.v[:self.rows, :, :self.width]

    @values.setter
    def values(self, value: Any) -> None:
        if value is not None:
            raise AttributeError("SlotLayer values are written through update() and the batch ops")

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """A forward pass's new columns for every live row."""
        assert key_states.shape[0] == self.rows, "a forward must cover every cached row"
        new = key_states.shape[-2]
        self._reserve(self.rows, self.width + new, key_states)
        assert self.k is not None and self.v is not None
        self.k[:self.rows, :, self.width:self.width + new] = key_states
        self.v[:self.rows, :, self.width:self.width + new] = value_states
        self.width += new
        self.is_initialized = True
        return self.k[:self.rows, :, :self.width], self.v[:self.rows, :, :self.width]

    def get_seq_length(self) -> int:
        return self.width

    def reset(self) -> None:
        self.k = self.v = None
        self.rows = self.width = 0
        self.is_initialized = False

    # -- batch operations (the runner's) --------------------------------------

    def move_rows(self, src: torch.Tensor, dst: torch.Tensor, rows: int) -> None:
        """Copy rows ``src`` to ``dst``, then keep the first ``rows``."""
        if len(src):
            assert self.k is not None and self.v is not None
            self.k[dst, :, :self.width] = self.k[src, :, :self.width]
            self.v[dst, :, :self.width] = self.v[src, :, :self.width]
        self.rows = rows

    def append(self, keys: torch.Tensor, values: torch.Tensor, width: int) -> None:
        """Add rows right-aligned at ``width`` columns (>= theirs and the current width)."""
        if width > self.width:
            self._widen_left(width - self.width, keys)
        first, count, theirs = self.rows, keys.shape[0], keys.shape[-2]
        self._reserve(first + count, self.width, keys)
        assert self.k is not None and self.v is not None
        self.k[first:first + count, :, :self.width - theirs] = 0
        self.v[first:first + count, :, :self.width - theirs] = 0
        self.k[first:first + count, :, self.width - theirs:self.width] = keys
        self.v[first:first + count, :, self.width - theirs:self.width] = values
        self.rows += count
        self.is_initialized = True

    def drop_left(self, columns: int) -> None:
        """Forget the first ``columns`` columns (padding in every row)."""
        if columns and self.k is not None and self.v is not None:
            keep = self.width - columns
            self.k[:self.rows, :, :keep] = self.k[:self.rows, :, columns:self.width].clone()
            self.v[:self.rows, :, :keep] = self.v[:self.rows, :, columns:self.width].clone()
            self.width = keep

    def _widen_left(self, columns: int, like: torch.Tensor) -> None:
        """Shift the live part right by ``columns`` zero columns."""
        self._reserve(self.rows, self.width + columns, like)
        assert self.k is not None and self.v is not None
        if self.rows and self.width:
            live = slice(columns, columns + self.width)
            self.k[:self.rows, :, live] = self.k[:self.rows, :, :self.width].clone()
            self.v[:self.rows, :, live] = self.v[:self.rows, :, :self.width].clone()
        self.k[:self.rows, :, :columns] = 0
        self.v[:self.rows, :, :columns] = 0
        self.width += columns

    def _reserve(self, rows: int, width: int, like: torch.Tensor) -> None:
        """Room for ``rows`` x ``width``; grows by doubling, copying the live part once."""
        if self.k is not None and self.v is not None and (
                rows <= self.k.shape[0] and width <= self.k.shape[2]):
            return
        have_rows, have_cols = (0, 0) if self.k is None else (self.k.shape[0], self.k.shape[2])
        shape = (_grow(have_rows, rows), like.shape[1], _grow(have_cols, width, 64),
                 like.shape[-1])
        k = like.new_zeros(shape)
        v = like.new_zeros(shape)
        if self.k is not None and self.v is not None:
            k[:self.rows, :, :self.width] = self.k[:self.rows, :, :self.width]
            v[:self.rows, :, :self.width] = self.v[:self.rows, :, :self.width]
        self.k, self.v = k, v


def _grow(have: int, need: int, least: int = 8) -> int:
    size = max(have, least)
    while size < need:
        size *= 2
    return size


class SlotCache(LayerCache):
    """A ``DynamicCache`` whose layers are ``SlotLayer``s."""

    def __init__(self, num_layers: int) -> None:
        super().__init__([SlotLayer() for _ in range(num_layers)])

    @property
    def slot_layers(self) -> list[SlotLayer]:
        layers: list[SlotLayer] = self.layers
        return layers
