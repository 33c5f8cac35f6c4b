"""One worker process per GPU (or per group of GPUs, for a model larger than
one), each pinned before torch can see any other.

``CUDA_VISIBLE_DEVICES`` must be set in the child's environment before torch
initialises CUDA, so the parent never imports torch: it counts GPUs with
``nvidia-smi`` (or reads ``CUDA_VISIBLE_DEVICES``) and starts one Celery worker
process per GPU with its own variable, device and node name.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field


class GpuSpecError(ValueError):
    pass


def visible_gpus(environ: dict[str, str] | None = None) -> list[str]:
    """The GPU ids this host offers: ``CUDA_VISIBLE_DEVICES`` if set, else nvidia-smi's."""
    env = os.environ if environ is None else environ
    preset = env.get("CUDA_VISIBLE_DEVICES")
    if preset is not None:
        return [g.strip() for g in preset.split(",") if g.strip() and g.strip() != "-1"]
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        listing = subprocess.run(["nvidia-smi", "--list-gpus"], capture_output=True, text=True,
                                 timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [str(i) for i, line in enumerate(listing.splitlines()) if line.startswith("GPU ")]


def parse_gpus(spec: str | None, available: list[str]) -> list[str]:
    """``0,1`` / ``all`` / ``none`` (or None: all if any GPU is seen) -> GPU ids; [] = CPU."""
    if spec is None:
        spec = "all" if available else "none"
    spec = spec.strip().lower()
    if spec in ("none", "cpu", ""):
        return []
    if spec == "all":
        if not available:
            raise GpuSpecError("--gpus all: no GPU is visible here (use --gpus none for the CPU)")
        return list(available)
    wanted = [g.strip() for g in spec.split(",") if g.strip()]
    if len(set(wanted)) != len(wanted):
        raise GpuSpecError(f"--gpus {spec}: a GPU is listed twice")
    unknown = [g for g in wanted if available and g not in available]
    if unknown:
        raise GpuSpecError(
            f"--gpus {spec}: GPU {', '.join(unknown)} not visible here "
            f"(visible: {', '.join(available) or 'none'})"
        )
    return wanted


@dataclass(frozen=True)
class WorkerProcess:
    """What one child process gets: its Celery node name and its environment."""

    node: str
    env: dict[str, str] = field(default_factory=dict)


def node_name(base: str, device: str, host: str = "%h") -> str:
    """``<base>-<device>@<host>``: unique per host as long as the bases differ.

    The base defaults to the queue, so two workers of one host serving two
    queues never share a name (a shared name is one consumer in the stream's
    group: the second process would take over the first one's jobs). A base
    with an ``@`` names the host part too.
    """
    name, at, given_host = base.partition("@")
    return f"{name}-{device}@{given_host if at else host}"


def plan(gpus: list[str], base: str = "default", host: str = "%h",
         per_worker: int = 1) -> list[WorkerProcess]:
    """The processes of a host: one per ``per_worker`` GPUs, in the order given."""
    if not gpus:
        return [WorkerProcess(node_name(base, "cpu", host),
                              {"CUDA_VISIBLE_DEVICES": "", "TOKENFLEET_DEVICE": "cpu"})]
    if len(gpus) % per_worker:
        raise GpuSpecError(f"--gpus-per-worker {per_worker}: {len(gpus)} GPU(s) "
                           f"({','.join(gpus)}) do not split into groups of {per_worker}")
    groups = [gpus[i:i + per_worker] for i in range(0, len(gpus), per_worker)]
    # Inside each child its GPUs are cuda:0.., whatever their host ids.
    return [
        WorkerProcess(node_name(base, "gpu" + "-".join(group), host),
                      {"CUDA_VISIBLE_DEVICES": ",".join(group), "TOKENFLEET_DEVICE": "cuda",
                       "TOKENFLEET_GPUS_PER_WORKER": str(per_worker)})
        for group in groups
    ]


def celery_command(node: str, loglevel: str = "INFO") -> list[str]:
    """The Celery worker one process runs (``-P solo``: the engine owns its threads).

    Celery runs under this interpreter (``python -m celery``), not whatever
    ``celery`` is first on PATH: a venv's ``tokenfleet`` started by its full
    path, as systemd or supervisor do, finds its own Celery and its own code.
    """
    # Celery's banner and its own lines only at DEBUG (tokenfleet.workers.celery_quiet).
    quiet = [] if loglevel.upper() == "DEBUG" else ["--quiet"]
    return [sys.executable, "-m", "celery", "-A", "tokenfleet.workers.app", *quiet, "worker",
            "-P", "solo", "-c", "1", "-n", node, "--without-mingle", "--without-gossip",
            "-l", loglevel]
