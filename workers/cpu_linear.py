"""The model's linear layers on the CPU through oneDNN, their weights packed once.

``nn.Linear`` on the CPU calls the BLAS (MKL) with the weight as stored, on
every call. oneDNN can instead reorder each weight once, at load, into the
blocked layout its kernels read, as vLLM's CPU backend does (``onednn_mm``).
Measured on this 2-core AMD host, one thread, float32: a decode-sized GEMM
(32 rows, 768 -> 2048) takes 0.93 ms packed against 1.91 ms, (2048 -> 768)
1.16 against 1.96 ms, and 10-25% less on the tiny model's small layers
(``tests/tools/bench_linear.py``). The results differ from ``F.linear`` only
in the order of the sums (float32 rounding).

Only plain ``nn.Linear`` layers of a float32 or bfloat16 model are packed;
quantized or otherwise special layers keep their own forward.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

log = logging.getLogger(__name__)

# The batch the weights' layout is tuned for: any row count runs, and the
# decode batches this serves (8 to 256 rows) differ by a few percent between
# hints (vLLM packs for 32).
ROWS_HINT = 64
PACKED_DTYPES = (torch.float32, torch.bfloat16)


class PackedLinear(nn.Module):  # type: ignore[misc]
    """``nn.Linear``'s forward over a oneDNN-packed copy of its weight."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(),
                                                                  ROWS_HINT)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(
            x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, oneDNN packed"


def available(model: Any) -> str | None:
    """Why ``model``'s linear layers cannot be packed (None: they can)."""
    param = next(model.parameters())
    if param.device.type != "cpu":
        return f"on {param.device.type}, not the CPU"
    if param.dtype not in PACKED_DTYPES:
        return f"{param.dtype} weights"
    if not torch.backends.mkldnn.is_available():
        return "this torch has no oneDNN"
    return None


def pack(model: Any) -> int:
    """Swap every plain ``nn.Linear`` of ``model`` for a ``PackedLinear``, in
    place; the unpacked weights go (but a tied one, which its embedding keeps).
    Returns how many were packed: 0 where ``available`` says why not, or when
    they were packed before."""
    why = available(model)
    if why is not None:
        log.info("linear layers not packed for oneDNN: %s", why)
        return 0
    swaps = [(parent, name, child) for parent in model.modules()
             for name, child in parent.named_children() if type(child) is nn.Linear]
    for parent, name, child in swaps:
        setattr(parent, name, PackedLinear(child))
    if swaps:
        log.info("%d linear layers packed for oneDNN", len(swaps))
    return len(swaps)
