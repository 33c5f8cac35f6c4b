"""Microbenchmark: nn.Linear against the oneDNN-packed linear (workers/cpu_linear.py)
on the GEMM shapes of the tiny model and the 86M shape, one torch thread.

    python tests/tools/bench_linear.py [--threads 1] [--rows 1,8,32,64,256]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
from torch import nn

from tokenfleet.workers.cpu_linear import PackedLinear

SHAPES = {"tiny": [(256, 256), (256, 688), (688, 256), (256, 1024)],
          "86m": [(768, 768), (768, 2048), (2048, 768), (768, 1024)]}


def per_call_us(call: Callable[[], object], seconds: float = 0.3) -> float:
    for _ in range(5):
        call()
    calls, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        call()
        calls += 1
    return (time.perf_counter() - started) / calls * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rows", default="1,8,32,64,256")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"{'model':6} {'rows':>5} {'in->out':>11} {'nn.Linear us':>13} {'packed us':>10} {'ratio':>6}")
    with torch.inference_mode():
        for model, shapes in SHAPES.items():
            for rows in map(int, args.rows.split(",")):
                for fan_in, fan_out in shapes:
                    linear = nn.Linear(fan_in, fan_out, bias=False)
                    packed = PackedLinear(linear)
                    x = torch.randn(rows, fan_in)
                    plain, fast = per_call_us(lambda: linear(x)), per_call_us(lambda: packed(x))
                    print(f"{model:6} {rows:5} {f'{fan_in}->{fan_out}':>11} {plain:13.0f} "
                          f"{fast:10.0f} {plain / fast:6.2f}")


if __name__ == "__main__":
    main()
