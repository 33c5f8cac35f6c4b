"""The first hour of a new user: install, start a worker, submit, get told what went wrong.

Each test runs the commands a user types (the installed ``tokenfleet`` script,
a wheel built from this repository, a fresh virtual environment) against a
real redis-server.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import sysconfig
import threading
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from helpers import stop_groups, wait_until

# Each test runs the installed command as a user does (a worker process, a wheel
# built and installed): seconds each, minutes together. CI runs them after the
# README's test command (README, "Run the tests").
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
# What an unactivated shell has on PATH: no virtual environment's bin.
PLAIN_PATH = "/usr/local/bin:/usr/bin:/bin"


@pytest.fixture(scope="session")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out),
                    str(ROOT)], check=True, timeout=300, capture_output=True)
    (built,) = out.glob("tokenfleet-*.whl")
    return built


def user_env(settings: Any, **extra: str) -> dict[str, str]:
    """An unactivated shell's environment pointed at the test's Redis."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    return {**env, "PATH": PLAIN_PATH, "TOKENFLEET_REDIS_URL": settings.redis_url,
            "TOKENFLEET_NAMESPACE": settings.namespace, "TOKENFLEET_HEARTBEAT_S": "0.5",
            "TOKENFLEET_TORCH_THREADS": "1", "TOKENFLEET_BLOCK_MS": "20", **extra}


def run(cmd: list[str], env: dict[str, str], timeout: float = 60,
        stdin: str | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, env=env, input=stdin, capture_output=True, text=True,
                          timeout=timeout, cwd=cwd or ROOT)


class HostWorkers:
    """``tokenfleet worker`` processes as a user starts them, stopped with SIGTERM."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[str]] = []

    def start(self, args: list[str], env: dict[str, str], script: Path = BIN / "tokenfleet",
              cwd: Path | None = None) -> subprocess.Popen[str]:
        proc = subprocess.Popen([str(script), "worker", "--gpus", "none", *args], env=env,
                                cwd=cwd or ROOT, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        stop_groups(self.procs)


@pytest.fixture
def host_workers() -> Iterator[HostWorkers]:
    workers = HostWorkers()
    yield workers
    workers.close()


def live_workers(r: redis.Redis, namespace: str) -> list[str]:
    return sorted(k.decode().split(":", 2)[2] for k in r.keys(f"{namespace}:workers:*"))


def test_a_wheel_installs_one_top_level_package_with_its_data(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"tokenfleet", wheel.name.split("-")[0] + "-"
                                                 + wheel.name.split("-")[1] + ".dist-info"}
    for needed in ("tokenfleet/__init__.py", "tokenfleet/shared/wire/lua/submit.lua",
                   "tokenfleet/shared/tiny_model/model.safetensors",
                   "tokenfleet/workers/app.py", "tokenfleet/py.typed"):
        assert needed in names
    assert not any("train_tiny" in n or "readability" in n for n in names)


@pytest.mark.timeout(600)
def test_the_bare_install_submits_without_torch(wheel: Path, tmp_path: Path, settings: Any,
                                                start_worker: Any) -> None:
    """A web backend's install: the client and its needs, no torch, no Celery."""
    venv = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    subprocess.run([str(venv / "bin/python"), "-m", "pip", "install", "-q", str(wheel)],
                   check=True, timeout=240, capture_output=True)
    start_worker()  # "elsewhere": this test's process, on the same Redis
    script = (
        "import importlib.util, sys\n"
        "import tokenfleet\n"
        "from tokenfleet import FleetClient, GenerationRequest, SamplingParams, JobStatus\n"
        "heavy = [m for m in ('torch', 'transformers', 'celery') if importlib.util.find_spec(m)]\n"
        "assert not heavy, heavy\n"
        f"client = FleetClient({settings.redis_url!r}, namespace={settings.namespace!r})\n"
        "job = client.submit(GenerationRequest(prompt='Hello', sampling=SamplingParams("
        "max_new_tokens=5)))\n"
        "state = client.wait(job, timeout=60)\n"
        "assert state.status is JobStatus.SUCCEEDED, state\n"
        "print(len(state.token_ids))\n"
    )
    out = run([str(venv / "bin/python"), "-c", script], env=user_env(settings), cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["5"]
    # Its command line submits too, refusing a queue nobody serves in one line.
    cli = run([str(venv / "bin/tokenfleet"), "submit", "Hi", "--max-new-tokens", "3", "--wait"],
              env=user_env(settings), cwd=tmp_path)
    assert cli.returncode == 0, cli.stderr
    refused = run([str(venv / "bin/tokenfleet"), "submit", "Hi", "--model", "nope"],
                  env=user_env(settings), cwd=tmp_path)
    assert refused.returncode == 3 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert "nope" in refused.stderr and "default" in refused.stderr
    # Every other command works, or says in one line which extra to install.
    tf = str(venv / "bin/tokenfleet")
    status = run([tf, "status"], env=user_env(settings), cwd=tmp_path)
    assert status.returncode == 0 and "default" in status.stdout, status.stderr
    exported = run([tf, "export-model", "tiny", str(tmp_path / "tiny")], env=user_env(settings),
                   cwd=tmp_path)
    assert exported.returncode == 0, exported.stderr
    for args, extra in [(["worker", "--gpus", "none"], "worker"), (["demo"], "demo"),
                        (["gateway"], "gateway"), (["bench"], "bench"),
                        (["metrics-exporter"], "exporter"),
                        (["export-model", "llama-86m", str(tmp_path / "x")], "worker")]:
        out = run([tf, *args], env=user_env(settings), cwd=tmp_path)
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 2 and len(lines) == 1, (args, out.stderr[-2000:])
        assert f'pip install "tokenfleet[{extra}]"' in lines[0], (args, lines)
    # The gateway flavour: its command gets past the install check (to the port
    # check here), the worker's still names its extra.
    subprocess.run([str(venv / "bin/python"), "-m", "pip", "install", "-q", "fastapi", "uvicorn",
                    "python-multipart", "httpx", "prometheus-client", "jinja2"],
                   check=True, timeout=240, capture_output=True)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        gateway = run([tf, "gateway", "--port", port], env=user_env(settings), cwd=tmp_path)
    assert gateway.returncode == 2 and f"port {port} on 127.0.0.1 is in use" in gateway.stderr
    worker = run([tf, "worker"], env=user_env(settings), cwd=tmp_path)
    assert worker.returncode == 2 and "needs the worker extra" in worker.stderr, worker.stderr


@pytest.mark.timeout(300)
def test_a_wheel_installed_for_real_serves_from_an_unactivated_venv(
        wheel: Path, tmp_path: Path, settings: Any, r: redis.Redis,
        host_workers: HostWorkers) -> None:
    """Not editable, not activated, started by its full path as systemd would: the
    worker finds its own Celery and its own code."""
    venv = tmp_path / "full"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    # The heavy dependencies come from this test run's environment (no second torch).
    site = next((venv / "lib").glob("python*/site-packages"))
    (site / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([str(venv / "bin/python"), "-m", "pip", "install", "-q", "--no-deps",
                    str(wheel)], check=True, timeout=240, capture_output=True)
    where = run([str(venv / "bin/python"), "-c", "import tokenfleet; print(tokenfleet.__file__)"],
                env=user_env(settings), cwd=tmp_path)
    assert str(site) in where.stdout, where.stdout + where.stderr
    proc = host_workers.start(["--model", "tiny", "--queue", "wheel"], user_env(settings),
                              script=venv / "bin/tokenfleet", cwd=tmp_path)
    wait_until(lambda: live_workers(r, settings.namespace) or proc.poll() is not None,
               timeout=120, what="the wheel's worker to send a heartbeat")
    assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
    out = run([str(venv / "bin/tokenfleet"), "submit", "Hello", "--model", "wheel",
               "--max-new-tokens", "4", "--wait", "--json"], env=user_env(settings), cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["status"] == "succeeded"


@pytest.mark.timeout(300)
def test_two_workers_on_one_host_are_two_and_a_third_with_a_taken_name_is_refused(
        settings: Any, r: redis.Redis, host_workers: HostWorkers) -> None:
    env = user_env(settings)
    a = host_workers.start(["--model", "tiny", "--queue", "alpha"], env)
    b = host_workers.start(["--model", "tiny", "--queue", "beta"], env)
    wait_until(lambda: len(live_workers(r, settings.namespace)) == 2
               or a.poll() is not None or b.poll() is not None,
               timeout=120, what="two workers to send heartbeats")
    status = run([str(BIN / "tokenfleet"), "status", "--json"], env=env)
    report = json.loads(status.stdout)
    names = sorted(w["name"] for w in report["workers"])
    assert len(names) == 2 and names[0].startswith("alpha-cpu@") and names[1].startswith("beta-cpu@")
    assert {q["queue"]: q["workers"] for q in report["queues"]} == {"alpha": 1, "beta": 1}
    again = run([str(BIN / "tokenfleet"), "worker", "--gpus", "none", "--model", "tiny",
                 "--queue", "alpha"], env=env)
    assert again.returncode == 2, again.stderr
    assert len(again.stderr.strip().splitlines()) == 1 and "in use" in again.stderr
    # Given a name of its own, a second worker of the same queue joins.
    host_workers.start(["--model", "tiny", "--queue", "alpha", "--name", "alpha2"], env)
    wait_until(lambda: len(live_workers(r, settings.namespace)) == 3, timeout=120,
               what="the third worker's heartbeat")


@pytest.mark.timeout(300)
def test_the_launcher_restarts_a_dead_worker_and_gives_up_on_one_that_keeps_dying(
        settings: Any, r: redis.Redis, host_workers: HostWorkers, tmp_path: Path) -> None:
    env = user_env(settings)
    proc = host_workers.start(["--model", "tiny", "--queue", "sup"], env)
    key = f"{settings.namespace}:workers:"
    first = wait_until(lambda: r.keys(key + "*"), timeout=120, what="the worker's heartbeat")
    pid = int(r.hget(first[0], "pid") or 0)
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: int(r.hget(first[0], "pid") or pid) != pid, timeout=120,
               what="a restarted worker process under the same name")
    assert proc.poll() is None
    # A model directory with every file loading needs, none of them loadable: the
    # child dies at each start (a corrupt download, say), for all the parent knows.
    broken = tmp_path / "broken-model"
    broken.mkdir()
    for name in ("config.json", "tokenizer.json", "model.safetensors"):
        (broken / name).write_text("{}")
    out = run([str(BIN / "tokenfleet"), "worker", "--gpus", "none", "--model", str(broken),
               "--queue", "broken", "--max-restarts", "2"], env=env, timeout=240)
    assert out.returncode != 0
    last = out.stderr.splitlines()[-1]
    assert "giving up" in last and ", 2 times in " in last, out.stderr[-2000:]


def test_everyday_failures_are_one_line_with_an_exit_code(tmp_path: Path, settings: Any) -> None:
    env = user_env(settings)
    tf = str(BIN / "tokenfleet")
    batch = tmp_path / "in.jsonl"
    batch.write_text('{"custom_id": "a", "method": "POST", "url": "/v1/completions", '
                     '"body": {"model": "default", "prompt": "Hi"}}\n')
    (tmp_path / "a-file").write_text("")  # no directory can be made under a file, even by root
    unwritable = f"file://{tmp_path}/a-file/files"
    cases = [
        # (command, extra env, exit code, words in the line)
        ([tf, "submit", "Hi"], {"TOKENFLEET_REDIS_URL": "redis://127.0.0.1:1/0"}, 4,
         "cannot reach Redis"),
        ([tf, "status"], {"TOKENFLEET_REDIS_URL": "127.0.0.1:6379"}, 4, "Redis URL"),
        ([tf, "worker", "--gpus", "none", "--model", str(tmp_path / "no-such-model")], {}, 2,
         "no such directory"),
        # The command line's errors name its options, not Python's parameters.
        ([tf, "submit", "Hi", "--model", "nobody-serves-this"], {}, 3,
         "pass --queue-ahead to queue ahead"),
        ([tf, "submit", "Hi", "--max-new-tokens", "0", "--queue-ahead"], {}, 3,
         "invalid --max-new-tokens"),
        ([tf, "submit", "Hi", "--queue-ahead", "--wait", "--timeout", "0.5"], {}, 5,
         "did not end"),
        ([tf, "status", "0" * 32], {}, 1, "no job"),
        ([tf, "batch", "submit", str(batch)], {"TOKENFLEET_FILES_URL": unwritable}, 2,
         f"the file store {unwritable} cannot be written"),
        ([tf, "batch", "submit", str(batch), "--completion-window", "2d"],
         {"TOKENFLEET_FILES_URL": f"file://{tmp_path}/files"}, 3, "invalid --completion-window"),
    ]
    for cmd, extra, code, words in cases:
        out = run(cmd, {**env, **extra}, timeout=60)  # the timeout catches a hang only
        assert out.returncode == code, (cmd, out.returncode, out.stderr)
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and words in lines[0], (cmd, out.stderr)
        assert "Traceback" not in out.stderr and "require_worker" not in out.stderr


def test_batch_submit_with_default_settings_uses_the_users_data_directory(
        tmp_path: Path, settings: Any) -> None:
    """A user who may not write /var/lib/tokenfleet (here: a path under a file,
    which nobody can create, root included) gets a store of their own."""
    batch = tmp_path / "in.jsonl"
    batch.write_text('{"custom_id": "a", "method": "POST", "url": "/v1/completions", '
                     '"body": {"model": "default", "prompt": "Hi"}}\n')
    (tmp_path / "a-file").write_text("")
    env = {k: v for k, v in user_env(settings, HOME=str(tmp_path / "home")).items()
           if k not in ("TOKENFLEET_FILES_URL", "XDG_DATA_HOME")}
    as_a_user = ("import pathlib, sys; import tokenfleet.shared.file_store as f; "
                 f"f.SYSTEM_DIR = pathlib.Path({str(tmp_path / 'a-file' / 'files')!r}); "
                 "from tokenfleet.cli.app import main; sys.argv[0] = 'tokenfleet'; main()")
    out = run([sys.executable, "-c", as_a_user, "batch", "submit", str(batch)], env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().startswith("batch_") and out.stderr == ""
    stored = tmp_path / "home" / ".local" / "share" / "tokenfleet" / "files"
    assert [p.read_text() for p in stored.rglob("*") if p.is_file()] == [batch.read_text()]


@pytest.mark.timeout(300)
def test_worker_mistakes_a_restart_cannot_fix_are_one_line_and_exit_2(
        tmp_path: Path, settings: Any) -> None:
    """Refused before any worker process starts: no traceback, no restart loop."""
    empty = tmp_path / "empty-model"
    empty.mkdir()
    with socket.socket() as taken:  # another process's metrics port
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        offline = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
        cases = [
            # (worker arguments, extra env, words in the line)
            (["--model", "gpt2"], {}, "a Hugging Face Hub id is given as hf:gpt2"),
            (["--model", str(empty)], {}, "lacks config.json, tokenizer files"),
            (["--model", "hf:openai-community/gpt2"], offline, "the Hugging Face Hub did not give"),
            (["--metrics-port", str(port)], {}, f"port {port} on 0.0.0.0 is in use"),
        ]
        for args, extra, words in cases:
            out = run([str(BIN / "tokenfleet"), "worker", "--gpus", "none", *args],
                      {**user_env(settings), **extra}, timeout=120)
            lines = out.stderr.strip().splitlines()
            assert out.returncode == 2 and len(lines) == 1, (args, out.stderr[-2000:])
            assert words in lines[0], (args, lines)


@pytest.mark.timeout(180)
def test_prompts_from_stdin_or_a_file_and_limits_checked_at_submit(
        tmp_path: Path, settings: Any, start_worker: Any) -> None:
    start_worker()
    env = user_env(settings)
    tf = str(BIN / "tokenfleet")
    piped = run([tf, "submit", "-", "--max-new-tokens", "4", "--wait"], env, stdin="Hello there")
    assert piped.returncode == 0, piped.stderr
    big = tmp_path / "big.txt"
    big.write_text("word " * 200_000)  # 1 MB: too big for an argument list, not for a file
    huge = run([tf, "submit", "--file", str(big)], env)
    assert huge.returncode == 3 and "TOKENFLEET_MAX_PROMPT_CHARS" in huge.stderr, huge.stderr
    # Within the character limit and the client's token limit (2048) but past
    # what the served model takes: refused at submit, naming the model's length.
    many = tmp_path / "many.txt"
    many.write_text("x y " * 750)
    refused = run([tf, "submit", "--file", str(many)], env)
    assert refused.returncode == 3, refused.stderr
    assert "the model allows 1023 (model length 1024)" in refused.stderr, refused.stderr


@pytest.mark.timeout(180)
def test_a_failed_job_fails_the_command_with_its_reason(settings: Any, start_worker: Any) -> None:
    start_worker(max_stop_strings=0)  # this worker refuses what the client lets through
    env = user_env(settings)
    tf = str(BIN / "tokenfleet")
    waited = run([tf, "submit", "a prompt", "--stop", ".", "--wait"], env)
    assert waited.returncode == 1 and "failed" in waited.stderr, waited.stderr
    assert "stop strings" in waited.stderr  # the reason, not just the status
    streamed = run([tf, "submit", "a prompt", "--stop", ".", "--stream"], env)
    assert streamed.returncode == 1 and "failed" in streamed.stderr, streamed.stderr


@pytest.mark.timeout(120)
def test_job_status_reads_as_text_and_as_typed_json(settings: Any, start_worker: Any) -> None:
    start_worker()
    env = user_env(settings)
    tf = str(BIN / "tokenfleet")
    job = run([tf, "submit", "Hello", "--max-new-tokens", "6", "--wait", "--json"], env)
    state = json.loads(job.stdout)
    text = run([tf, "status", state["id"]], env).stdout
    assert f"job {state['id']}: succeeded" in text and state["text"] in text
    assert len(text.splitlines()) < 12  # token ids are not listed one per line
    fleet = json.loads(run([tf, "status", "--json"], env).stdout)
    (worker,) = fleet["workers"]
    for field in ("pid", "max_batch", "prefetch", "running", "waiting", "last_seen"):
        assert isinstance(worker[field], (int, float)), (field, worker[field])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_worker_log_from_start_to_a_ctrl_c_drain_is_short_and_ends_with_a_closing_line(
        settings: Any, client: Any, host_workers: HostWorkers) -> None:
    proc = host_workers.start(["--model", "tiny", "--queue", "quiet-q"], user_env(settings))
    stdout = proc.stdout
    assert stdout is not None
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(line.rstrip("\n") for line in stdout))
    reader.start()
    wait_until(lambda: any(" started: queue 'quiet-q', model tiny, engine hf, " in line
                           for line in lines), timeout=180, what="the worker's start line")
    job_id = client.submit("Hello", model="quiet-q", max_new_tokens=4, require_worker=False)
    state = client.wait(job_id, timeout=120)
    assert state.status.value == "succeeded"
    interrupted = time.monotonic()
    proc.send_signal(signal.SIGINT)  # what Ctrl-C sends (to the parent: its children have
    proc.wait(timeout=120)  # process groups of their own)
    exit_s = time.monotonic() - interrupted
    reader.join(30)
    log = "\n".join(lines)
    assert proc.returncode == 0, log
    assert len(lines) < 15, log
    for celery_noise in ("[tasks]", "[queues]", "SecurityWarning", "superuser", "Ctrl+C",
                         "Warm shutdown", "ready."):
        assert celery_noise not in log, (celery_noise, log)
    assert "stopped: 1 job(s) finished here, 0 handed back to the queue; the stop took" in (
        lines[-1]), log
    # An idle worker exits within a second of the drain (0.8 s measured on a loaded host;
    # 6 to 15 s when the interpreters tore torch down on their way out).
    assert exit_s < 5, (exit_s, log)
