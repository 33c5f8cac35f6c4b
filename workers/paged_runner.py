"""The model runner over the paged KV cache: one packed forward pass per step.

A step's tokens, decodes and prefill chunks alike, go through the model as one
row (``[1, tokens]``, each with its own position), so the linear layers see no
padding at all; the attention (``tokenfleet.workers.paged_cache``) writes
each token's key and value to its sequence's blocks and reads each sequence's
own. Logits are computed only where a sequence makes a token. Like
``HFRunner`` it knows tensors and sequence ids only.
"""

from __future__ import annotations

from typing import Any

import torch

from tokenfleet.shared import models
from tokenfleet.workers import paged_cache
from tokenfleet.workers.paged_cache import Chunk, PagedKVCache, StepPlan
from tokenfleet.workers.sampler import sample
from tokenfleet.workers.scheduler import Batch


class PagedRunner:
    """Owned by the engine thread."""

    def __init__(self, model: Any, tokenizer: Any, block_size: int = 32) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        paged_cache.install(model)
        text = model.config.get_text_config(decoder=True)
        heads = int(text.num_attention_heads)
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
        kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
        dtype = next(model.parameters()).dtype
        self._like = torch.zeros((kv_heads, head_dim), dtype=dtype, device=self.device)
        self.cache = PagedKVCache(int(text.num_hidden_layers), block_size)

    @property
    def max_model_len(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 2048))

    @property
    def eos_token_ids(self) -> set[int]:
        return models.eos_token_ids(self.model.generation_config, self.model.config,
                                    self.tokenizer)

    def reset(self) -> None:
        self.cache.reset()

    def run(self, batch: Batch) -> list[int]:
        self._free_left(batch)
        with torch.inference_mode():
            plan, ids, positions, last = self._plan(batch)
            out = self.model(input_ids=ids, position_ids=positions, use_cache=False,
                             # A 4D mask is taken as given: no causal mask is built.
                             attention_mask=torch.ones((1, 1, 1, 1), dtype=torch.bool),
                             logits_to_keep=last, **{paged_cache.STEP_ARG: plan})
            return sample(out.logits[0], batch.sampled) if batch.sampled else []

    def _free_left(self, batch: Batch) -> None:
        """Free the blocks of sequences that left (ended, dropped) since the last step."""
        here = {s.job_id for s in batch.seqs} | {s.job_id for s in batch.keep}
        for seq_id in [j for j in self.cache.tables if j not in here]:
            self.cache.release(seq_id)

    def _plan(self, batch: Batch) -> tuple[StepPlan, torch.Tensor, torch.Tensor, torch.Tensor]:
        cache, bs = self.cache, self.cache.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        last: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lengths: list[int] = []
        chunks: list[Chunk] = []
        for seq, n in zip(batch.seqs, batch.num_new):
            start, end = seq.num_computed, seq.num_computed + n
            table = cache.reserve(seq.job_id, end, self._like)
            first = len(ids)
            ids.extend(seq.all_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(cache.slots(table, start, end))
            if end == seq.num_tokens:
                last.append(len(ids) - 1)
            if n == 1 and not chunks:  # the scheduler puts decodes first
                decode_tables.append(table)
                decode_lengths.append(end)
            else:
                chunks.append(Chunk(first, len(ids), start, torch.tensor(table, device=self.device)))
        width = max(map(len, decode_tables), default=0)
        blocks = torch.tensor([t + [0] * (width - len(t)) for t in decode_tables],
                              dtype=torch.long, device=self.device)
        lengths = torch.tensor(decode_lengths, device=self.device)
        mask = torch.arange(width * bs, device=self.device)[None, :] < lengths[:, None]
        plan = StepPlan(cache, torch.tensor(slots, device=self.device), len(decode_tables),
                        blocks, mask[:, None, None, :], chunks)

        def row(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.long, device=self.device)

        return plan, row(ids)[None], row(positions)[None], row(last)
