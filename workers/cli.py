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
    from shared.settings import get_settings

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
    from workers.demo import PROMPTS, run_demo

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
    from workers.pinning import GpuSpecError, celery_command, parse_gpus, plan, visible_gpus

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

    from producer import FleetClient, QueueFull

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
    from producer import FleetClient, JobNotFound
    from producer.fleet import fleet_status

    _apply_env(redis_url=redis_url)
    with FleetClient() as client:
        if job_id:
            try:
                click.echo(client.status(job_id).model_dump_json(indent=2))
            except JobNotFound as exc:
                raise click.ClickException(str(exc)) from exc
            return
        if watch:
            from producer.fleet import watch as watch_fleet

            watch_fleet(client)
            return
        report = fleet_status(client)
        if as_json:
            click.echo(json.dumps(report, indent=2))
        else:
            from producer.fleet import render

            render(report)


@main.command()
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=int, default=8000, show_default=True)
@redis_option
def gateway(host: str, port: int, redis_url: str | None) -> None:
    """Serve the HTTP gateway: jobs, token streams (SSE), OpenAI-style completions."""
    try:
        import uvicorn

        from producer.gateway import create_app
    except ImportError as exc:
        raise click.ClickException(
            f"the gateway needs FastAPI and uvicorn ({exc}): pip install 'tokenfleet[gateway]'"
        ) from exc

    _apply_env(redis_url=redis_url)
    uvicorn.run(create_app(), host=host, port=port)


@main.command("export-model")
@click.argument("name")
@click.argument("directory", type=click.Path(file_okay=False, path_type=Path))
def export_model(name: str, directory: Path) -> None:
    """Write a built-in model (e.g. 'tiny') as a Hugging Face directory."""
    from shared.models import export

    try:
        out = export(name, directory)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    click.echo(f"wrote {name} to {out}")


if __name__ == "__main__":
    main()
