"""The model runner: a Hugging Face causal LM over one batched KV cache.

Rows of the cache are sequences, left-padded to a common length. A prefill runs
the new prompts together and appends their rows; a decode step feeds each
row's last token. Rows of sequences that left are dropped before the next
forward, and columns that only padding uses any more are trimmed, so the cache
stays as long as the longest sequence still running. The runner knows tensors
and sequence ids only: no Redis, no Celery, no job states.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from transformers import DynamicCache

from workers.sampler import sample
from workers.scheduler import Batch
from workers.sequence import Sequence


class HFRunner:
    def __init__(self, model: Any, tokenizer: Any) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        pad = tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else 0
        # transformers renamed past_key_values to cache (5.x); take what this one has.
        params = inspect.signature(model.forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        self.rows: list[str] = []  # job id of each cache row
        self.cache: DynamicCache | None = None
        self.mask = torch.zeros(0, 0, dtype=torch.long, device=self.device)
        self.positions = torch.zeros(0, dtype=torch.long, device=self.device)

    @property
    def max_model_len(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 2048))

    @property
    def eos_token_ids(self) -> set[int]:
        ids: set[int] = set()
        for source in (self.model.generation_config, self.model.config, self.tokenizer):
            eos = getattr(source, "eos_token_id", None)
            ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
        return ids

    def reset(self) -> None:
        self.rows, self.cache = [], None
        self.mask = self.mask[:0, :0]
        self.positions = self.positions[:0]

    def run(self, batch: Batch) -> list[int]:
        with torch.inference_mode():
            if batch.is_prefill:
                self._keep_rows(batch.keep)
                logits = self._prefill(batch.seqs)
            else:
                self._keep_rows(batch.seqs)
                logits = self._decode(batch.seqs)
            return sample(logits, batch.seqs)

    def _prefill(self, seqs: list[Sequence]) -> torch.Tensor:
        lengths = [s.num_tokens for s in seqs]
        width = max(lengths)
        ids = torch.full((len(seqs), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        for row, seq in enumerate(seqs):
            ids[row, width - lengths[row]:] = torch.tensor(seq.all_ids)
            mask[row, width - lengths[row]:] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(dim=1) - 1).clamp_min(0)
        cache = DynamicCache()
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions,
                         use_cache=True, logits_to_keep=1, **{self._cache_arg: cache})
        self._append_rows([s.job_id for s in seqs], cache, mask)
        return out.logits[:, -1, :]

    def _decode(self, seqs: list[Sequence]) -> torch.Tensor:
        last = torch.tensor([[s.generated[-1]] for s in seqs], device=self.device)
        ones = torch.ones((len(seqs), 1), dtype=torch.long, device=self.device)
        self.mask = torch.cat([self.mask, ones], dim=1)
        out = self.model(input_ids=last, attention_mask=self.mask,
                         position_ids=self.positions[:, None], use_cache=True,
                         **{self._cache_arg: self.cache})
        self.positions = self.positions + 1
        return out.logits[:, -1, :]

    def _keep_rows(self, seqs: list[Sequence]) -> None:
        """Make the cache rows exactly ``seqs``, in order."""
        wanted = [s.job_id for s in seqs]
        if wanted == self.rows:
            return
        if not wanted:
            self.reset()
            return
        where = {job_id: row for row, job_id in enumerate(self.rows)}
        index = torch.tensor([where[j] for j in wanted], device=self.device)
        assert self.cache is not None
        self.cache.batch_select_indices(index)
        self.mask, self.positions, self.rows = self.mask[index], self.positions[index], wanted
        # Trim the columns on the left that only padding holds now.
        used = self.mask.any(dim=0).nonzero()
        first = int(used[0]) if len(used) else 0
        if first:
            for layer in self.cache.layers:
                layer.keys = layer.keys[..., first:, :]
                layer.values = layer.values[..., first:, :]
            self.mask = self.mask[:, first:]

    def _append_rows(self, job_ids: list[str], cache: DynamicCache, mask: torch.Tensor) -> None:
        positions = mask.sum(dim=1)
        if self.cache is None or not self.rows:
            self.cache, self.mask, self.positions, self.rows = cache, mask, positions, job_ids
            return
        old, new = self.mask.shape[1], mask.shape[1]
        width = max(old, new)
        for mine, theirs in zip(self.cache.layers, cache.layers):
            mine.keys = torch.cat([_pad_left(mine.keys, width), _pad_left(theirs.keys, width)])
            mine.values = torch.cat([_pad_left(mine.values, width),
                                     _pad_left(theirs.values, width)])
        self.mask = torch.cat([_pad_left(self.mask, width), _pad_left(mask, width)])
        self.positions = torch.cat([self.positions, positions])
        self.rows = self.rows + job_ids


def _pad_left(t: torch.Tensor, width: int) -> torch.Tensor:
    """Zero-pad the sequence axis (-2 for keys/values [b, h, t, d], -1 for masks)."""
    axis = -2 if t.dim() == 4 else -1
    missing = width - t.shape[axis]
    if missing == 0:
        return t
    shape = list(t.shape)
    shape[axis] = missing
    return torch.cat([t.new_zeros(shape), t], dim=axis)
