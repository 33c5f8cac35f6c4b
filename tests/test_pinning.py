"""One Celery process per GPU, each pinned by CUDA_VISIBLE_DEVICES before torch starts."""

from __future__ import annotations

import pytest

from tokenfleet.workers.pinning import GpuSpecError, celery_command, parse_gpus, plan, visible_gpus


def test_gpu_lists_all_and_none() -> None:
    assert parse_gpus("0,1", ["0", "1", "2"]) == ["0", "1"]
    assert parse_gpus("all", ["0", "1"]) == ["0", "1"]
    assert parse_gpus("none", ["0", "1"]) == []
    assert parse_gpus(None, []) == []  # no GPU seen: the CPU
    assert parse_gpus(None, ["0"]) == ["0"]


@pytest.mark.parametrize("spec, message", [("3", "not visible"), ("0,0", "twice"),
                                           ("all", "no GPU is visible")])
def test_bad_gpu_specs_say_why(spec: str, message: str) -> None:
    available = ["0", "1"] if spec != "all" else []
    with pytest.raises(GpuSpecError, match=message):
        parse_gpus(spec, available)


def test_each_gpu_gets_its_own_process_node_and_device() -> None:
    procs = plan(["0", "3"], base="llama", host="h")
    assert [p.node for p in procs] == ["llama-gpu0@h", "llama-gpu3@h"]
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in procs] == ["0", "3"]
    assert all(p.env["TOKENFLEET_DEVICE"] == "cuda" for p in procs)


def test_gpus_per_worker_gives_each_process_a_group_of_gpus() -> None:
    procs = plan(["0", "1", "2", "3"], base="big", host="h", per_worker=2)
    assert [p.node for p in procs] == ["big-gpu0-1@h", "big-gpu2-3@h"]
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in procs] == ["0,1", "2,3"]
    assert all(p.env["TOKENFLEET_GPUS_PER_WORKER"] == "2" for p in procs)
    with pytest.raises(GpuSpecError, match="do not split into groups of 2"):
        plan(["0", "1", "2"], per_worker=2)


def test_the_cpu_plan_hides_every_gpu() -> None:
    (proc,) = plan([], host="h")
    assert proc.node == "default-cpu@h" and proc.env == {"CUDA_VISIBLE_DEVICES": "",
                                                   "TOKENFLEET_DEVICE": "cpu"}


def test_visible_gpus_honours_a_preset_cuda_visible_devices() -> None:
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "2,5"}) == ["2", "5"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == []


def test_node_names_tell_the_workers_of_one_host_apart() -> None:
    assert plan([], base="a", host="h")[0].node != plan([], base="b", host="h")[0].node
    assert plan(["1"], base="mine@box", host="h")[0].node == "mine-gpu1@box"


def test_each_process_is_a_solo_celery_worker_of_the_app_under_this_interpreter() -> None:
    import sys

    cmd = celery_command("gpu1@h")
    assert cmd[:8] == [sys.executable, "-m", "celery", "-A", "tokenfleet.workers.app", "--quiet",
                       "worker", "-P"]
    assert "solo" in cmd and cmd[cmd.index("-n"):cmd.index("-n") + 2] == ["-n", "gpu1@h"]
    # Celery's banner and its own lines only when asked for.
    assert "--quiet" not in celery_command("gpu1@h", "DEBUG")


@pytest.mark.slow
def test_pinning_reaches_torch_in_the_child(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The variable is in the child's environment before torch is imported there."""
    import os
    import subprocess
    import sys

    (proc,) = plan(["0"], host="h")
    code = "import os, torch; print(os.environ['CUDA_VISIBLE_DEVICES'], torch.cuda.device_count() <= 1)"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **proc.env},
                         capture_output=True, text=True, timeout=120, check=True).stdout
    assert out.split() == ["0", "True"]
