"""The model runner over the paged KV cache: one packed forward pass per step.

A step's tokens, decodes and prefill chunks alike, go through the model as one
row (``[1, tokens]``, each with its own position), so the linear layers see no
padding at all; the attention (``tokenfleet.workers.paged_cache``) writes
each token's key and value to its sequence's blocks and reads each sequence's
own. Logits are computed only where a sequence makes a token. Like
``HFRunner`` it knows tensors and sequence ids only.

With ``prefix_cache`` on, a sequence the scheduler admits starts from the
longest run of cached full blocks its tokens begin with (``cached_prefix``:
they are shared, not copied, and not computed again), and every full block a
step writes is named for the next (``tokenfleet.workers.prefix_cache``).
"""

from __future__ import annotations

from typing import Any

import torch

from tokenfleet.workers import paged_cache, prompt_logprobs
from tokenfleet.workers.paged_cache import Chunk, Decodes, PagedKVCache, StepPlan
from tokenfleet.workers.prefix_cache import ROOT, chain
from tokenfleet.workers.runner import ModelLimits
from tokenfleet.workers.sampler import sample
from tokenfleet.workers.scheduler import StepBatch
from tokenfleet.workers.sequence import Sequence

# Decodes within this many tokens of each other always attend together.
GROUP_SLACK = 64


class PagedRunner(ModelLimits):
    """Owned by the engine thread."""

    chunked_prefill = True  # a step's prompt chunks ride with its decodes
    rows_at_longest = False  # a sequence takes the blocks of its own tokens only

    def __init__(self, model: Any, tokenizer: Any, block_size: int = paged_cache.BLOCK_SIZE,
                 prefix_cache: bool = True) -> None:
        self.model = model
        self.prefix_cache = prefix_cache
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
        # seq id -> the hashes of its named full blocks, in order (the chain's links)
        self._chains: dict[str, list[int]] = {}
        # Prompt tokens of the admitted sequences, and those found cached (the
        # worker's stats and metrics); and the prompt tokens the model computed.
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0
        self.prefill_tokens = 0

    def reset(self) -> None:
        self.cache.reset()
        self._chains.clear()

    def cached_prefix(self, seq: Sequence) -> int:
        """The tokens of ``seq`` (admitted now, nothing computed) already in
        cached blocks, which its table now starts with: whole blocks, and never
        its last token (the step that computes it makes the first logits). A
        sequence that wants its prompt's log probabilities computes them all."""
        self.cache.release(seq.job_id)
        self._chains.pop(seq.job_id, None)
        if not self.prefix_cache or prompt_logprobs.asks(seq):
            return 0
        self.prefix_query_tokens += seq.num_tokens
        return self._share_cached(seq, 0, seq.num_tokens)

    def _share_cached(self, seq: Sequence, start: int, end: int) -> int:
        """Share the cached blocks that go on ``seq``'s table from token
        ``start`` (a block's first, the table's end) toward ``end``, never its
        last token; where its computing starts now."""
        size = self.cache.block_size
        links = self._chains.setdefault(seq.job_id, [])
        names = chain(seq.all_ids, size, min(end, seq.num_tokens - 1) // size, start // size,
                      links[-1] if links else ROOT)
        found: list[int] = []
        for name, link in names:
            block = self.cache.prefixes.find(name)
            if block is None:
                break
            found.append(block)
            links.append(link)
        self.cache.share(seq.job_id, found)
        self.prefix_hit_tokens += len(found) * size
        return start + len(found) * size

    def _name_full_blocks(self, seq: Sequence, table: list[int], end: int) -> None:
        """Name the blocks of ``seq`` this step fills (its tokens up to ``end``)."""
        links = self._chains.setdefault(seq.job_id, [])
        full = end // self.cache.block_size
        if full <= len(links):
            return
        for i, (name, link) in enumerate(
                chain(seq.all_ids, self.cache.block_size, full, len(links),
                      links[-1] if links else ROOT), start=len(links)):
            self.cache.prefixes.name(name, table[i])
            links.append(link)

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
            self._chains.pop(seq_id, None)
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
                self._chains.pop(seq.job_id, None)
            if (self.prefix_cache and n > 1 and start % cache.block_size == 0
                    and not prompt_logprobs.asks(seq)):
                # Blocks named since it was admitted (earlier in this very plan:
                # the n choices of one prompt, a prompt sent twice at once) are
                # written in this pass before any attention reads them.
                start = self._share_cached(seq, start, end)
                if start == end:
                    continue
            if start < len(seq.prompt_ids):
                self.prefill_tokens += end - start
            table = cache.reserve(seq.job_id, end, self._like)
            if self.prefix_cache:
                self._name_full_blocks(seq, table, end)
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
