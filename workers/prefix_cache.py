"""Automatic prefix caching for the paged KV cache: full blocks found again by
the tokens that filled them.

A full block of a sequence is named by its tokens and by the name of the
block before it (a chain from the sequence's first token), so a name stands
for the whole run of tokens up to the block's end: two sequences that share a
prompt's first blocks share their names, and a new sequence reuses the longest
run of cached blocks that starts its own tokens and prefills only the rest.
The name is the tuple ``(hash of the name before, its tokens)``, compared
whole as a dict key: two runs share a block only with the same tokens in it
and runs before it whose names hash alike (a 64-bit hash of the whole chain).

A cached block stays in the store after the last sequence that held it
leaves, parked (least recently left first) until its room is wanted: a block
is taken from the free list first, then from the oldest parked one, whose
name is forgotten. A block is named once it is full and written (the step
that fills it plans it); a sequence that filled a block someone else had
named already keeps its own copy, unnamed.

Reference counts are the paged cache's (``PagedKVCache``): a block is parked
when its count falls to zero and it has a name.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

# The name of "no block before": the root of every chain.
ROOT = 0

BlockName = tuple[int, tuple[int, ...]]


def chain(token_ids: Sequence[int], block_size: int, blocks: int,
          first: int = 0, before: int = ROOT) -> list[tuple[BlockName, int]]:
    """The names (and each name's hash: the next link's ``before``) of full
    blocks ``first`` to ``blocks - 1`` of ``token_ids``, after the block whose
    hash is ``before``."""
    out = []
    for i in range(first, blocks):
        name = (before, tuple(token_ids[i * block_size:(i + 1) * block_size]))
        before = hash(name)
        out.append((name, before))
    return out


class PrefixIndex:
    """Name -> block for the full blocks written, and the parked ones (no
    sequence holds them) in the order they were left."""

    def __init__(self) -> None:
        self.blocks: dict[BlockName, int] = {}
        self.names: dict[int, BlockName] = {}  # block -> its name
        self.parked: OrderedDict[int, None] = OrderedDict()

    def clear(self) -> None:
        self.blocks.clear()
        self.names.clear()
        self.parked.clear()

    def find(self, name: BlockName) -> int | None:
        return self.blocks.get(name)

    def name(self, name: BlockName, block: int) -> None:
        """Name ``block`` (full and written) unless another block has the name."""
        if name not in self.blocks and block not in self.names:
            self.blocks[name] = block
            self.names[block] = name

    def holds(self, block: int) -> bool:
        return block in self.names

    def park(self, block: int) -> None:
        """The last sequence holding a named block left: keep it, most recent last."""
        self.parked[block] = None

    def unpark(self, block: int) -> None:
        self.parked.pop(block, None)

    def evict(self) -> int:
        """The oldest parked block, its name forgotten: a free block now."""
        block, _ = self.parked.popitem(last=False)
        del self.blocks[self.names.pop(block)]
        return block
