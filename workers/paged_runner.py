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

from tokenfleet.workers import paged_cache, prompt_logprobs
from tokenfleet.workers.paged_cache import Chunk, Decodes, PagedKVCache, StepPlan
from tokenfleet.workers.runner import ModelLimits
from tokenfleet.workers.sampler import sample
from tokenfleet.workers.scheduler import StepBatch

# Decodes within this many tokens of each other always attend together.
GROUP_SLACK = 64


class PagedRunner(ModelLimits):
    """Owned by the engine thread."""

    chunked_prefill = True  # a step's prompt chunks ride with its decodes
    rows_at_longest = False  # a sequence takes the blocks of its own tokens only

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
        self._prompt = prompt_logprobs.ChunkKeep()  # prompt logprobs, for the jobs that ask

    def reset(self) -> None:
        self.cache.reset()

    def run(self, batch: StepBatch) -> list[int]:
        self._free_left(batch)
        with torch.inference_mode():
            plan, ids, positions, last = self._plan(batch)
            out = self.model(input_ids=ids, position_ids=positions, use_cache=False,
                             # A 4D mask is taken as given: no causal mask is built.
                             attention_mask=torch.ones((1, 1, 1, 1), dtype=torch.bool),
                             logits_to_keep=last, **{paged_cache.STEP_ARG: plan})
            logits = out.logits[0]
            if self._prompt.step:  # the rows kept for prompt logprobs follow the sampled ones
                self._prompt.take(logits[len(batch.sampled):])
            return (sample(logits[:len(batch.sampled)], batch.sampled, self.eos_token_ids)
                    if batch.sampled else [])

    def _free_left(self, batch: StepBatch) -> None:
        """Free the blocks of sequences that left (ended, dropped) since the last step."""
        here = {s.job_id for s in batch.seqs} | {s.job_id for s in batch.keep}
        for seq_id in [j for j in self.cache.tables if j not in here]:
            self.cache.release(seq_id)
            self._prompt.partial.pop(seq_id, None)

    def _plan(self, batch: StepBatch) -> tuple[StepPlan, torch.Tensor, torch.Tensor, torch.Tensor]:
        cache = self.cache
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        last: dict[int, int] = {}  # id(seq) -> packed index of its last token
        # Decodes first, shortest first, so that groups of similar length are
        # contiguous; then the prefill chunks.
        order = sorted(zip(batch.seqs, batch.num_new),
                       key=lambda sn: (sn[1] > 1, sn[0].num_tokens if sn[1] == 1 else 0))
        decodes: list[tuple[int, list[int]]] = []  # (length, block table), in packed order
        chunks: list[Chunk] = []
        kept: list[int] = []  # packed indices whose logits prompt logprobs need
        self._prompt.step = []
        for seq, n in order:
            start, end = seq.num_computed, seq.num_computed + n
            if start == 0:
                # A prefill from the start: blocks left under this id (a job
                # dropped and taken again between two steps) hold nothing of it.
                cache.release(seq.job_id)
            table = cache.reserve(seq.job_id, end, self._like)
            first = len(ids)
            kept += self._prompt.plan(seq, start, end, first)
            ids.extend(seq.all_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(cache.slots(table, start, end))
            if end == seq.num_tokens:
                last[id(seq)] = len(ids) - 1
            if n == 1:
                decodes.append((end, table))
            else:
                chunks.append(Chunk(first, len(ids), start, self._tensor(table)))
        plan = StepPlan(cache, self._tensor(slots), self._group(decodes), chunks)
        logits_at = [last[id(s)] for s in batch.sampled] + kept
        return (plan, self._tensor(ids)[None], self._tensor(positions)[None],
                self._tensor(logits_at))

    def _group(self, decodes: list[tuple[int, list[int]]]) -> list[Decodes]:
        """Split decodes (shortest first) where the length doubles, by more
        than ``GROUP_SLACK`` tokens: each group is padded to its longest."""
        groups: list[Decodes] = []
        first = 0
        for i in range(1, len(decodes) + 1):
            if i < len(decodes) and not (decodes[i][0] > 2 * decodes[first][0]
                                         and decodes[i][0] - decodes[first][0] > GROUP_SLACK):
                continue
            members = decodes[first:i]
            width = len(members[-1][1])
            blocks = self._tensor([t + [0] * (width - len(t)) for _, t in members])
            lengths = self._tensor([length for length, _ in members])
            keys = torch.arange(width * self.cache.block_size, device=self.device)
            padding = keys[None, :] >= lengths[:, None]
            mask = torch.zeros(padding.shape, dtype=self._like.dtype, device=self.device)
            mask.masked_fill_(padding, float("-inf"))
            groups.append(Decodes(first, i, blocks, mask[:, None, None, :]))
            first = i
        return groups

    def _tensor(self, values: list[int] | list[list[int]]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)
