"""A paged KV cache for the built-in engine, and the attention that reads it.

Why our own and not transformers' ``PagedAttentionCache`` (continuous
batching's, run with ``attn_implementation="paged|sdpa"``): on a CPU that
cache takes its index path, which gathers every cached token of the whole
batch into one packed key tensor per layer and attends with one dense
``[tokens, cached + tokens]`` mask, so a decode step costs batch² × length in
attention; its block-table path needs ``flash_attn_with_kvcache`` (CUDA only).
Its API (sectors, allocators, ``RequestState``) is internal and changes from
one minor version to the next. What we do
take from the library is its seam: a function registered with
``AttentionInterface`` that the model's own layers call with the new keys and
values of a packed batch (the way ``paged|sdpa`` works), and
``sdpa_attention_forward`` for every other forward.

The store: per layer, keys and values in blocks of ``block_size`` tokens
(``[blocks * block_size, kv_heads, head_dim]``); a sequence holds a list of
blocks (its block table). Memory is the tokens held, rounded up to a block per
sequence, not rows × the longest row; a sequence that leaves gives its blocks
back and nothing moves. Full blocks may be shared (a prompt's start, found by
``tokenfleet.workers.prefix_cache``): each block counts the sequences that
hold it, and a shared block is read, never written. When neither free nor
parked blocks are left the store doubles (one copy).

The attention of one step (``StepPlan``): the batch is packed, one row of
tokens: decode tokens first (one per sequence), then prefill chunks. Every new
token's key and value is written to its slot; decodes of similar lengths
attend together, their blocks gathered into a padded ``[decodes, heads,
longest, dim]`` with a key-padding mask (one SDPA call per group: a long
prompt's decode does not pad all the others to its length); each prefill
chunk attends on its own over its past and itself, causally.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tokenfleet.shared.compat.hf_transformers import sdpa_attention, use_attention
from tokenfleet.workers.prefix_cache import PrefixIndex

ATTENTION = "tokenfleet_paged"
STEP_ARG = "tokenfleet_step"  # the forward's keyword that carries the StepPlan


# Tokens per block: what a cached prefix is counted in (a prompt's last partial
# block is never shared).
BLOCK_SIZE = 32


@dataclass
class Chunk:
    """A prefill chunk: packed tokens ``start:end`` of a sequence with ``past``
    tokens cached before them, whose blocks are ``blocks``."""

    start: int
    end: int
    past: int
    blocks: torch.Tensor


@dataclass
class Decodes:
    """Packed tokens ``start:end``: one decode token each, of sequences of
    similar length (so that padding them to the longest costs little)."""

    start: int
    end: int
    blocks: torch.Tensor  # [decodes, blocks of the longest]: padded block tables
    # [decodes, 1, 1, blocks * block_size]: 0 for a real key, -inf for padding
    # (additive: SDPA on a CPU is slower with a boolean mask)
    mask: torch.Tensor


@dataclass
class StepPlan:
    """Everything the attention of every layer needs for one packed forward."""

    cache: PagedKVCache
    slots: torch.Tensor  # [tokens]: where each new token's key and value go
    decodes: list[Decodes]
    chunks: list[Chunk]


class PagedKVCache:
    """Owned by the engine thread (through the runner)."""

    def __init__(self, num_layers: int, block_size: int = BLOCK_SIZE,
                 initial_blocks: int = 64) -> None:
        self.num_layers = num_layers
        self.block_size = block_size
        self.initial_blocks = initial_blocks
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        self.free: list[int] = []
        self.tables: dict[str, list[int]] = {}
        self.holders: dict[int, int] = {}  # block -> how many tables hold it
        self.prefixes = PrefixIndex()
        # The blocks the cache may grow to before a parked prefix gives way to a
        # new block (the worker's memory budget, ``max_batch_tokens``): grown only
        # to the running jobs' blocks, it lost the prefixes a batch was not
        # running at that moment, and a service's system prompts took turns.
        self.keep_blocks = 0

    @property
    def num_blocks(self) -> int:
        return self.k[0].shape[0] // self.block_size if self.k else 0

    def reset(self) -> None:
        self.k, self.v, self.free, self.tables, self.holders = [], [], [], {}, {}
        self.prefixes.clear()

    def release(self, seq_id: str) -> None:
        for block in self.tables.pop(seq_id, []):
            self.holders[block] -= 1
            if self.holders[block] == 0:
                del self.holders[block]
                if self.prefixes.holds(block):
                    self.prefixes.park(block)  # kept, for the next prompt that starts so
                else:
                    self.free.append(block)

    def share(self, seq_id: str, blocks: list[int]) -> None:
        """Add cached ``blocks`` (its next tokens', already written) to
        ``seq_id``'s table."""
        self.tables.setdefault(seq_id, []).extend(blocks)
        for block in blocks:
            self.holders[block] = self.holders.get(block, 0) + 1
            self.prefixes.unpark(block)

    def reserve(self, seq_id: str, num_tokens: int, like: torch.Tensor) -> list[int]:
        """Blocks for ``num_tokens`` tokens of ``seq_id``; returns its block table."""
        table = self.tables.setdefault(seq_id, [])
        need = -(-num_tokens // self.block_size) - len(table)
        if need > len(self.free) and self.num_blocks < self.keep_blocks:
            self._grow(need - len(self.free), like, most=self.keep_blocks - self.num_blocks)
        room = len(self.free) + len(self.prefixes.parked)
        if need > room:
            self._grow(need - room, like)
        for _ in range(need):
            block = self.free.pop() if self.free else self.prefixes.evict()
            self.holders[block] = 1
            table.append(block)
        return table

    def slots(self, table: list[int], start: int, end: int) -> list[int]:
        """The flat slots of token positions ``start:end`` of a sequence."""
        bs = self.block_size
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    def _grow(self, at_least: int, like: torch.Tensor, most: int | None = None) -> None:
        """``like``: [kv_heads, head_dim] in the dtype and device of the keys.
        Doubles (at least), by no more than ``most`` unless ``at_least`` is more."""
        have = self.num_blocks
        more = max(at_least, have, self.initial_blocks)
        if most is not None:
            more = max(at_least, min(more, most))
        shape = ((have + more) * self.block_size, *like.shape)
        for store in (self.k, self.v):
            for layer in range(self.num_layers):
                grown = like.new_zeros(shape)
                if layer < len(store):
                    grown[:have * self.block_size] = store[layer]
                    store[layer] = grown
                else:
                    store.append(grown)
        # Pop from the end: low block numbers first, so a small batch stays compact.
        self.free.extend(range(have + more - 1, have - 1, -1))

    def gather(self, layer: int, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of ``blocks`` ([rows, n]) as [rows, kv_heads, n * block_size, dim]
        (``index_select``: a fifth of the time of indexing with a 2-D tensor on a CPU)."""
        k, v = self.k[layer], self.v[layer]
        shape = (*blocks.shape[:-1], blocks.shape[-1] * self.block_size, *k.shape[1:])
        flat = blocks.reshape(-1)
        k = k.view(-1, self.block_size, *k.shape[1:]).index_select(0, flat)
        v = v.view(-1, self.block_size, *v.shape[1:]).index_select(0, flat)
        return k.view(shape).transpose(-3, -2), v.view(shape).transpose(-3, -2)


def paged_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, scaling: float | None = None,
                    dropout: float = 0.0, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """An ``AttentionInterface`` function: the paged attention of a packed
    forward when it carries a ``StepPlan``, plain SDPA for any other forward
    (``generate()``, the rectangular runner) on the same model."""
    plan: StepPlan | None = kwargs.pop(STEP_ARG, None)
    if plan is None:
        return sdpa_attention(module, query, key, value, attention_mask,
                              dropout=dropout, scaling=scaling, **kwargs)
    layer = module.layer_idx
    cache = plan.cache
    # [1, heads, tokens, dim] -> [tokens, heads, dim]
    q = query[0].transpose(0, 1)
    cache.k[layer].index_copy_(0, plan.slots, key[0].transpose(0, 1))
    cache.v[layer].index_copy_(0, plan.slots, value[0].transpose(0, 1))
    gqa = query.shape[1] != key.shape[1]
    out = torch.empty_like(q)
    for group in plan.decodes:
        k, v = cache.gather(layer, group.blocks)
        out[group.start:group.end] = torch.nn.functional.scaled_dot_product_attention(
            q[group.start:group.end, :, None], k, v, attn_mask=group.mask, scale=scaling,
            enable_gqa=gqa)[:, :, 0]
    for chunk in plan.chunks:
        chunk_q = q[chunk.start:chunk.end].transpose(0, 1)[None]
        if chunk.past:
            length = chunk.past + chunk.end - chunk.start
            k, v = cache.gather(layer, chunk.blocks[None])
            k, v = k[..., :length, :], v[..., :length, :]
            rows = torch.arange(chunk.past, length, device=q.device)[:, None]
            mask = rows >= torch.arange(length, device=q.device)[None, :]
            attended = torch.nn.functional.scaled_dot_product_attention(
                chunk_q, k, v, attn_mask=mask, scale=scaling, enable_gqa=gqa)
        else:  # a prompt's first chunk: its own keys are all there is
            attended = torch.nn.functional.scaled_dot_product_attention(
                chunk_q, key[:, :, chunk.start:chunk.end], value[:, :, chunk.start:chunk.end],
                is_causal=True, scale=scaling, enable_gqa=gqa)
        out[chunk.start:chunk.end] = attended[0].transpose(0, 1)
    return out[None], None


def install(model: Any) -> None:
    """Make ``model`` call ``paged_attention``; it stays SDPA for any other use."""
    use_attention(model, ATTENTION, paged_attention)
