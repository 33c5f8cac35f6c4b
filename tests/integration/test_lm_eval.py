"""lm-eval 0.4.13 against the fleet: ``--model local-completions`` through the gateway
(token-id prompts, ``echo`` with ``logprobs``) scores a small multiple-choice task kept
in the repository (tests/data/lm_eval) as lm-eval's own ``--model hf`` does on the same
weights: the same accuracy, and every choice's loglikelihood within 1e-4.

lm-eval runs from a venv of its own, ``.venv-lmeval`` (``ci/lm-eval-venv`` makes it),
so that its dependencies stay out of the test extra; without it these tests skip. Run
with ``-s`` to see the figures (accuracy each side, largest difference, wall times)."""

from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from gateway_server import gateway, port_of  # noqa: F401  (a fixture)

ROOT = Path(__file__).resolve().parents[2]
LM_EVAL = ROOT / ".venv-lmeval" / "bin" / "lm_eval"
# The task's data_files is relative: lm_eval runs in this folder (tokenfleet_mc.yaml).
TASK_DIR = ROOT / "tests" / "data" / "lm_eval"
TASK = "tokenfleet_mc"
TOLERANCE = 1e-4
RUN_TIMEOUT_S = 300

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(900),
    pytest.mark.skipif(not LM_EVAL.exists(),
                       reason=f"lm-eval's venv is absent ({LM_EVAL}): run ci/lm-eval-venv"),
]


@dataclass
class Run:
    accuracy: float
    # (doc_id, choice) -> the choice's loglikelihood
    loglikelihoods: dict[tuple[int, int], float]
    wall_s: float


def lm_eval(out: Path, tmp: Path, *args: str) -> Run:
    """Run lm_eval on the task with --log_samples and read back what it wrote."""
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "HF_HOME": str(tmp / "hf"),
           "OPENAI_API_KEY": "", "TOKENIZERS_PARALLELISM": "false"}
    command = [str(LM_EVAL), *args, "--tasks", TASK, "--include_path", str(TASK_DIR),
               "--log_samples", "--output_path", str(out)]
    started = time.monotonic()
    done = subprocess.run(command, cwd=TASK_DIR, env=env, capture_output=True, text=True,
                          timeout=RUN_TIMEOUT_S)
    wall_s = time.monotonic() - started
    output = done.stdout + done.stderr
    if done.returncode != 0:
        raise AssertionError(f"{' '.join(command)} exited {done.returncode}:\n{output[-6000:]}")
    [results] = out.rglob("results_*.json")
    [samples] = out.rglob(f"samples_{TASK}_*.jsonl")
    accuracy = json.loads(results.read_text())["results"][TASK]["acc,none"]
    loglikelihoods = {}
    for line in samples.read_text().splitlines():
        sample = json.loads(line)
        for choice, (loglikelihood, _greedy) in enumerate(sample["filtered_resps"]):
            loglikelihoods[(sample["doc_id"], choice)] = float(loglikelihood)
    return Run(accuracy, loglikelihoods, wall_s)


@pytest.fixture(scope="module")
def hf_run(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Run:
    """lm-eval's own transformers model on the tiny model's weights, in float32 on
    the CPU as the worker serves them."""
    tmp = tmp_path_factory.mktemp("lm_eval_hf")
    return lm_eval(tmp / "out", tmp, "--model", "hf",
                   "--model_args", f"pretrained={tiny_dir},dtype=float32",
                   "--device", "cpu", "--batch_size", "1")


# --batch_size 4 sends four prompts in one /v1/completions request.
@pytest.mark.parametrize("batch_size", [1, 4])
def test_local_completions_scores_as_lm_evals_hf_model_does(
    batch_size: int, hf_run: Run, gateway: Any, start_worker: Any, tiny_dir: Path,
    tmp_path: Path
) -> None:
    start_worker()
    url = f"http://127.0.0.1:{port_of(gateway())}/v1/completions"
    # The tiny model's tokenizer puts <|bos|> first, as lm-eval's hf model encodes the
    # context; local-completions adds it only when asked (add_bos_token=True).
    model_args = ",".join([
        "model=default", f"base_url={url}", f"tokenizer={tiny_dir}",
        "tokenizer_backend=huggingface", "add_bos_token=True", "num_concurrent=1",
        "max_retries=1",
    ])
    fleet = lm_eval(tmp_path / "out", tmp_path, "--model", "local-completions",
                    "--model_args", model_args, "--batch_size", str(batch_size))

    assert fleet.loglikelihoods.keys() == hf_run.loglikelihoods.keys()
    differences = {key: abs(fleet.loglikelihoods[key] - hf_run.loglikelihoods[key])
                   for key in hf_run.loglikelihoods}
    worst = max(differences, key=differences.__getitem__)
    print(f"\nlm-eval {TASK}: {len(differences)} choices of "
          f"{len({doc for doc, _ in differences})} questions, batch_size {batch_size}\n"
          f"  accuracy: local-completions {fleet.accuracy:.4f}, hf {hf_run.accuracy:.4f}\n"
          f"  largest |loglikelihood difference|: {differences[worst]:.3g} "
          f"(question {worst[0]}, choice {worst[1]})\n"
          f"  wall time: local-completions {fleet.wall_s:.1f} s, hf {hf_run.wall_s:.1f} s")
    far = {key: (fleet.loglikelihoods[key], hf_run.loglikelihoods[key])
           for key, d in differences.items() if d > TOLERANCE}
    assert not far, f"loglikelihoods (fleet, hf) more than {TOLERANCE} apart: {far}"
    assert fleet.accuracy == hf_run.accuracy
