"""The ``tokenfleet`` command line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import click

ENV_OPTIONS = {  # CLI option -> setting, passed on through the environment
    "redis_url": "TOKENFLEET_REDIS_URL",
    "model": "TOKENFLEET_MODEL",
    "queue": "TOKENFLEET_QUEUE",
    "max_batch": "TOKENFLEET_MAX_BATCH",
    "prefetch": "TOKENFLEET_PREFETCH",
    "namespace": "TOKENFLEET_NAMESPACE",
}


def _apply_env(**options: Any) -> None:
    """Options override the environment, so settings (and child processes) see them."""
    from tokenfleet.shared.settings import get_settings

    for name, value in options.items():
        if value is not None and name in ENV_OPTIONS:
            os.environ[ENV_OPTIONS[name]] = str(value)
    get_settings.cache_clear()


redis_option = click.option("--redis-url", default=None,
                            help="Redis URL (default: $TOKENFLEET_REDIS_URL)")


@click.group()
def main() -> None:
    """tokenfleet: an LLM inference fleet behind Redis Streams."""


@main.command()
@click.option("--redis-url", default=None,
              help="use this Redis instead of the embedded in-process fakeredis")
@click.option("--max-new-tokens", default=48, show_default=True)
@click.option("--temperature", default=0.0, show_default=True)
@click.argument("prompts", nargs=-1)
def demo(redis_url: str | None, max_new_tokens: int, temperature: float,
         prompts: tuple[str, ...]) -> None:
    """Run a worker and stream a few prompts, all in this process."""
    from tokenfleet.workers.demo import PROMPTS, run_demo

    run_demo(redis_url, list(prompts) or PROMPTS, max_new_tokens, temperature)


@main.command()
@click.option("--gpus", default=None,
              help="GPU ids '0,1', 'all' or 'none' (default: all if any GPU is seen)")
@click.option("--model", default=None, help="'tiny' or a Hugging Face model directory")
@click.option("--queue", default=None, help="queue (model name) to serve")
@click.option("--max-batch", type=int, default=None)
@click.option("--prefetch", type=int, default=None)
@click.option("--metrics-port", type=int, default=None,
              help="serve Prometheus metrics; the worker of the i-th GPU uses PORT+i")
@redis_option
@click.option("--loglevel", default="INFO", show_default=True)
def worker(gpus: str | None, loglevel: str, metrics_port: int | None, **options: Any) -> None:
    """Start this host's workers: one GPU-pinned Celery process per GPU."""
    from tokenfleet.workers.pinning import GpuSpecError, celery_command, parse_gpus, plan, visible_gpus

    _apply_env(**options)
    try:
        chosen = parse_gpus(gpus, visible_gpus())
    except GpuSpecError as exc:
        raise click.UsageError(str(exc)) from exc
    children = []
    for index, proc in enumerate(plan(chosen)):
        env = {**os.environ, **proc.env}
        if metrics_port is not None:
            env["TOKENFLEET_METRICS_PORT"] = str(metrics_port + index)
        cmd = celery_command(proc.node, loglevel)
        click.echo(f"starting {proc.node}: {' '.join(cmd)}", err=True)
        children.append(subprocess.Popen(cmd, env=env))

    def forward(signum: int, _frame: Any) -> None:
        for child in children:
            if child.poll() is None:
                child.send_signal(signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, forward)
    codes = [child.wait() for child in children]
    sys.exit(max(codes, default=0))


@main.command()
@click.argument("prompt")
@click.option("--max-new-tokens", default=64, show_default=True)
@click.option("--temperature", default=1.0, show_default=True)
@click.option("--model", "queue", default="default", show_default=True, help="queue name")
@click.option("--stream", is_flag=True, help="print tokens as they come")
@click.option("--wait", is_flag=True, help="wait for the result and print it")
@click.option("--timeout", default=300.0, show_default=True)
@redis_option
def submit(prompt: str, max_new_tokens: int, temperature: float, queue: str, stream: bool,
           wait: bool, timeout: float, redis_url: str | None) -> None:
    """Enqueue one job; print its id (or its tokens with --stream)."""
    from pydantic import ValidationError

    from tokenfleet import FleetClient, QueueFull

    _apply_env(redis_url=redis_url)
    with FleetClient() as client:
        try:
            job_id = client.submit(prompt, max_new_tokens=max_new_tokens,
                                   temperature=temperature, model=queue)
        except (ValidationError, QueueFull) as exc:
            raise click.ClickException(str(exc)) from exc
        if stream:
            for event in client.stream(job_id, timeout=timeout):
                click.echo(event.text, nl=False)
            click.echo()
            state = client.status(job_id)
            click.echo(f"[{state.status.value}: {state.finish_reason.value if state.finish_reason else '-'}]", err=True)
        elif wait:
            state = client.wait(job_id, timeout=timeout)
            click.echo(state.model_dump_json(indent=2))
        else:
            click.echo(job_id)


@main.command()
@click.argument("job_id", required=False)
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@click.option("--watch", is_flag=True, help="refresh the fleet view every second")
@redis_option
def status(job_id: str | None, as_json: bool, watch: bool, redis_url: str | None) -> None:
    """One job's state, or the fleet's queues and workers."""
    from tokenfleet import FleetClient, JobNotFound
    from tokenfleet.fleet import fleet_status

    _apply_env(redis_url=redis_url)
    with FleetClient() as client:
        if job_id:
            try:
                click.echo(client.status(job_id).model_dump_json(indent=2))
            except JobNotFound as exc:
                raise click.ClickException(str(exc)) from exc
            return
        if watch:
            from tokenfleet.fleet import watch as watch_fleet

            watch_fleet(client)
            return
        report = fleet_status(client)
        if as_json:
            click.echo(json.dumps(report, indent=2))
        else:
            from tokenfleet.fleet import render

            render(report)


@main.command()
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=int, default=8000, show_default=True)
@redis_option
def gateway(host: str, port: int, redis_url: str | None) -> None:
    """Serve the HTTP gateway: jobs, token streams (SSE), OpenAI-style completions."""
    try:
        import uvicorn

        from tokenfleet.gateway import create_app
    except ImportError as exc:
        raise click.ClickException(
            f"the gateway needs FastAPI and uvicorn ({exc}): pip install 'tokenfleet[gateway]'"
        ) from exc

    _apply_env(redis_url=redis_url)
    uvicorn.run(create_app(), host=host, port=port)


def _int_list(ctx: click.Context, param: click.Parameter, value: str) -> list[int]:
    try:
        return [int(v) for v in value.split(",") if v.strip()]
    except ValueError as exc:
        raise click.BadParameter(f"{value!r}: give whole numbers separated by commas, "
                                 "e.g. 1,4,16,64,256") from exc


@main.command()
@click.option("--model", default="tiny", show_default=True,
              help="'tiny', 'tiny-wide' or a Hugging Face model directory")
@click.option("--jobs", default=256, show_default=True, help="jobs per run")
@click.option("--concurrency", default="1,4,16,64,256", show_default=True,
              callback=_int_list, help="concurrent jobs (the engine's batch size), comma-separated")
@click.option("--max-new-tokens", default=32, show_default=True,
              help="the longest job; lengths spread over half of this to all of it")
@click.option("--rate", type=float, default=None,
              help="jobs per second arriving at a fixed rate (default: all submitted at once)")
@click.option("--modes", default="direct,fleet,naive,overhead", show_default=True,
              help="which of direct, fleet, naive, overhead to run")
@click.option("--redis-url", default=None,
              help="an existing Redis (default: a redis-server started on a free port)")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path),
              default=None, help="write every figure to this JSON file")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False, path_type=Path),
              default=None, help="write a PNG of throughput against concurrency (matplotlib)")
@click.option("--device", default="cpu", show_default=True, help="cpu or cuda")
@click.option("--dtype", default="auto", show_default=True,
              help="the model's dtype in every mode: auto (bfloat16 on cuda, float32 on cpu) "
                   "or a torch dtype name such as bfloat16")
@click.option("--soak", default=0, show_default=True,
              help="also pass this many short jobs through one worker and watch its memory")
@click.option("--probe-jobs", default=50, show_default=True,
              help="jobs of the low-load probe (one at a time: time to first token)")
@click.option("--overhead-jobs", default=2000, show_default=True,
              help="one-token jobs and Celery no-op tasks for the per-job cost")
@click.option("--repeat", default=1, show_default=True,
              help="run each measurement this many times, modes taking turns; keep the best")
def bench(model: str, jobs: int, concurrency: list[int], max_new_tokens: int,
          rate: float | None, modes: str, redis_url: str | None, json_path: Path | None,
          plot_path: Path | None, device: str, dtype: str, soak: int, probe_jobs: int,
          overhead_jobs: int, repeat: int) -> None:
    """Benchmark the fleet against the model in-process and naive Celery."""
    from rich.console import Console

    from tokenfleet.workers.bench.procs import BenchError
    from tokenfleet.workers.bench.report import plot, render
    from tokenfleet.workers.bench.run import BenchConfig, run_bench

    cfg = BenchConfig(model=model, jobs=jobs, concurrency=concurrency,
                      max_new_tokens=max_new_tokens, rate=rate,
                      modes=[m.strip() for m in modes.split(",") if m.strip()],
                      redis_url=redis_url, device=device, dtype=dtype, soak=soak,
                      probe_jobs=probe_jobs,
                      overhead_jobs=overhead_jobs, repeat=repeat)
    try:
        results = run_bench(cfg)
    except BenchError as exc:
        raise click.ClickException(str(exc)) from exc
    render(results, Console() if sys.stdout.isatty() else Console(width=120))
    if json_path is not None:
        json_path.write_text(json.dumps(results, indent=2))
        click.echo(f"wrote {json_path}", err=True)
    if plot_path is not None:
        try:
            click.echo(f"wrote {plot(results, plot_path)}", err=True)
        except RuntimeError as exc:
            raise click.ClickException(str(exc)) from exc


@main.command("export-model")
@click.argument("name")
@click.argument("directory", type=click.Path(file_okay=False, path_type=Path))
def export_model(name: str, directory: Path) -> None:
    """Write a built-in model (e.g. 'tiny') as a Hugging Face directory."""
    from tokenfleet.shared.models import export

    try:
        out = export(name, directory)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    click.echo(f"wrote {name} to {out}")


if __name__ == "__main__":
    main()
