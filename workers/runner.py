"""The model runner: a Hugging Face causal LM over one batched KV cache.

Rows of the cache are sequences, left-padded to a common length. A prefill runs
the new prompts together, packed end to end in one row with no padding (left-
padded to the longest for a model whose attention is not plain causal SDPA),
and adds their rows; a decode step feeds each row's last token. Rows of
sequences that left are given up before the next forward
(``tokenfleet.workers.kv_cache`` keeps that cheap), so the cache stays as wide
as the longest sequence still running. Rows are in the cache's order, not the
scheduler's: inputs are gathered and tokens handed back by job id. The runner
knows tensors and sequence ids only: no Redis, no Celery, no job states.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache

from tokenfleet.shared import models
from tokenfleet.shared.compat import hf_transformers
from tokenfleet.workers import prompt_logprobs
from tokenfleet.workers.kv_cache import SlotCache
from tokenfleet.workers.sampler import sample
from tokenfleet.workers.scheduler import StepBatch
from tokenfleet.workers.sequence import Sequence


def not_plain_attention(model: Any) -> str | None:
    """Why ``model``'s attention is not plain causal attention over all of a
    sequence's keys (None: it is). The paged attention computes only that, and
    so does a packed prefill's mask: a model whose attention windows, caps or
    sinks its scores gets the rectangular cache and padded prefills, which run
    the model's own attention and masks."""
    text = model.config.get_text_config(decoder=True)
    if getattr(text, "sliding_window", None) and getattr(text, "use_sliding_window", True):
        return "sliding-window attention"
    if getattr(text, "attn_logit_softcapping", None):
        return "attention logit soft-capping"
    layer_types = getattr(text, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types):
        return f"attention layers of types {sorted(set(layer_types))}"
    if "sink" in type(model).__name__.lower() or getattr(text, "attention_sinks", None):
        return "attention sinks"
    return None


class ModelLimits:
    """What the engine reads from a runner's model: its length, end tokens and
    vocabulary."""

    model: Any
    tokenizer: Any

    @property
    def max_model_len(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 2048))

    @property
    def eos_token_ids(self) -> set[int]:
        return models.eos_token_ids(self.model.generation_config, self.model.config,
                                    self.tokenizer)

    @property
    def vocab_size(self) -> int:
        """The rows of the model's input embedding: a token id at or past it
        makes the forward pass index outside it."""
        return int(self.model.get_input_embeddings().num_embeddings)


class HFRunner(ModelLimits):
    chunked_prefill = False  # a prefill runs whole, in a step of its own
    rows_at_longest = True  # rows are as wide as the longest sequence

    def __init__(self, model: Any, tokenizer: Any) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        pad = tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else 0
        self._cache_arg = hf_transformers.cache_keyword(model)
        self._layers = int(model.config.get_text_config(decoder=True).num_hidden_layers)
        # Packed prefills pass their own boolean mask, which only SDPA takes as
        # given, and mean plain causal attention: a model that windows its
        # attention (or runs eager or flash attention) gets padded prefills.
        self._packs = (hf_transformers.attn_implementation(model) == "sdpa"
                       and not_plain_attention(model) is None)
        self.rows: list[str] = []  # job id of each cache row
        self.cache = SlotCache(self._layers)
        self.mask = torch.zeros(0, 0, dtype=torch.long, device=self.device)
        self.positions = torch.zeros(0, dtype=torch.long, device=self.device)
        self.prefill_tokens = 0  # prompt tokens run through the model (the worker's stats)

    def reset(self) -> None:
        self.rows, self.cache = [], SlotCache(self._layers)
        self.mask = self.mask[:0, :0]
        self.positions = self.positions[:0]

    def run(self, batch: StepBatch) -> list[int]:
        with torch.inference_mode():
            if batch.is_prefill:
                self._keep_rows(batch.keep)
                self.prefill_tokens += sum(s.num_tokens for s in batch.seqs)
                return sample(self._prefill(batch.seqs), batch.seqs, self.eos_token_ids)
            self._keep_rows(batch.seqs)
            by_id = {s.job_id: s for s in batch.seqs}
            ordered = [by_id[job_id] for job_id in self.rows]
            tokens = dict(zip(self.rows, sample(self._decode(ordered), ordered, self.eos_token_ids)))
            return [tokens[s.job_id] for s in batch.seqs]

    def _prefill(self, seqs: list[Sequence]) -> torch.Tensor:
        if len(seqs) > 1 and self._packs:
            return self._prefill_packed(seqs)
        return self._prefill_padded(seqs)

    def _prefill_packed(self, seqs: list[Sequence]) -> torch.Tensor:
        """The prompts packed end to end in one row, each attending to its own
        tokens only (a block-diagonal causal mask): the linear layers see no
        padding. Their keys and values then go into the cache's rows. The
        scheduler bounds a step's prompts together (max_prefill_tokens), so the
        [tokens, tokens] mask stays small."""
        lengths = [s.num_tokens for s in seqs]
        count = torch.tensor(lengths, device=self.device)
        ends = count.cumsum(0)
        starts = ends - count
        total, width = sum(lengths), max(lengths)
        ids = torch.tensor([t for s in seqs for t in s.all_ids], device=self.device)[None]
        owner = torch.repeat_interleave(torch.arange(len(seqs), device=self.device), count)
        positions = torch.arange(total, device=self.device) - starts[owner]
        causal = torch.ones((total, total), dtype=torch.bool, device=self.device).tril_()
        mask = (owner[:, None] == owner[None, :]) & causal
        cache = DynamicCache()
        keep = prompt_logprobs.PackedKeep(seqs, lengths)
        out = self.model(input_ids=ids, attention_mask=mask[None, None],
                         position_ids=positions[None], use_cache=True,
                         logits_to_keep=torch.tensor(keep.keep, device=self.device)
                         if keep.any else ends - 1, **{self._cache_arg: cache})
        # Row r of the rectangle, right-aligned: column c holds token
        # c - (width - length) of prompt r; left of it, padding (masked; the
        # pack's first token, so finite).
        column = torch.arange(width, device=self.device)
        pad = width - count
        rows_mask = (column[None, :] >= pad[:, None]).long()
        source = (starts[:, None] + column[None, :] - pad[:, None]) * rows_mask
        self._append_rows([s.job_id for s in seqs], [
            (layer.keys[0][:, source].transpose(0, 1), layer.values[0][:, source].transpose(0, 1))
            for layer in cache.layers], rows_mask)
        return keep.take(out.logits[0], seqs) if keep.any else out.logits[0]

    def _prefill_padded(self, seqs: list[Sequence]) -> torch.Tensor:
        """The prompts left-padded to the longest, the model making its own masks
        (one prompt alone: no padding at all)."""
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
        # Every position's logits only where a prompt's log probabilities are asked for.
        asking = [row for row, seq in enumerate(seqs) if prompt_logprobs.asks(seq)]
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions,
                         use_cache=True, logits_to_keep=0 if asking else 1,
                         **{self._cache_arg: cache})
        self._append_rows([s.job_id for s in seqs], [(layer.keys, layer.values)
                                                     for layer in cache.layers], mask)
        for row in asking:
            seq = seqs[row]
            seq.prompt_logprobs = prompt_logprobs.compute(
                out.logits[row, width - lengths[row]:], seq.prompt_ids,
                seq.sampling.prompt_logprobs or 0)
        return out.logits[:, -1, :]

    def _decode(self, seqs: list[Sequence]) -> torch.Tensor:
        """One token for every row; ``seqs`` in row order."""
        last = torch.tensor([[s.generated[-1]] for s in seqs], device=self.device)
        ones = torch.ones((len(seqs), 1), dtype=torch.long, device=self.device)
        self.mask = torch.cat([self.mask, ones], dim=1)
        out = self.model(input_ids=last, attention_mask=self.mask,
                         position_ids=self.positions[:, None], use_cache=True,
                         **{self._cache_arg: self.cache})
        self.positions = self.positions + 1
        return out.logits[:, -1, :]

    def _keep_rows(self, seqs: list[Sequence]) -> None:
        """Keep the rows of ``seqs`` only: each row that leaves takes the last
        staying row, so only the moved rows are copied."""
        wanted = {s.job_id for s in seqs}
        if len(wanted) == len(self.rows) and all(j in wanted for j in self.rows):
            return
        assert wanted.issubset(self.rows), "a sequence without a cache row"
        rows = len(wanted)
        holes = [i for i, j in enumerate(self.rows[:rows]) if j not in wanted]
        movers = [i for i in range(rows, len(self.rows)) if self.rows[i] in wanted]
        src = torch.tensor(movers, dtype=torch.long, device=self.device)
        dst = torch.tensor(holes, dtype=torch.long, device=self.device)
        for layer in self.cache.slot_layers:
            layer.move_rows(src, dst, rows)
        self.mask[dst], self.positions[dst] = self.mask[src], self.positions[src]
        self.mask, self.positions = self.mask[:rows], self.positions[:rows]
        kept = self.rows[:rows]
        for hole, mover in zip(holes, movers):
            kept[hole] = self.rows[mover]
        self.rows = kept
        self._drop_padding()

    def _drop_padding(self) -> None:
        """Drop the columns on the left that no row uses, once they are worth
        the copy (attention over masked columns costs little; moving the
        cache costs a full copy)."""
        width = self.mask.shape[1]
        used = self.mask.any(dim=0).nonzero()
        first = int(used[0]) if len(used) else width
        if first == width or first >= max(16, width // 4):
            for layer in self.cache.slot_layers:
                layer.drop_left(first)
            self.mask = self.mask[:, first:]

    def _append_rows(self, job_ids: list[str],
                     layers: list[tuple[torch.Tensor, torch.Tensor]], mask: torch.Tensor) -> None:
        """Add rows: each layer's (keys, values) [rows, heads, columns, head_dim],
        left-padded as ``mask`` [rows, columns] says."""
        width = max(self.mask.shape[1], mask.shape[1])
        for mine, (keys, values) in zip(self.cache.slot_layers, layers):
            mine.append(keys, values, width)
        self.mask = torch.cat([_pad_left(self.mask, width), _pad_left(mask, width)])
        self.positions = torch.cat([self.positions, mask.sum(dim=1)])
        self.rows = self.rows + job_ids


def _pad_left(mask: torch.Tensor, width: int) -> torch.Tensor:
    """Zero-pad a [rows, columns] mask on the left to ``width`` columns."""
    missing = width - mask.shape[1]
    if missing == 0:
        return mask
    return torch.cat([mask.new_zeros((mask.shape[0], missing)), mask], dim=1)
