"""``tokenfleet bench``: the fleet side by side with the model's own batched speed.

- ``workload``: the jobs every mode runs (prompts, lengths, arrival times) and
  how a run's timings become figures;
- ``procs``: the processes a run needs (a redis-server, Celery workers, HTTP servers);
- ``modes``: direct, fleet, naive Celery and overhead, each one run;
- ``naive_app``: the Celery app of the naive pattern (a task per prompt);
- ``run``: the whole benchmark, its table, JSON and plot;
- ``vs_vllm`` (``--vs-vllm``): vLLM's own OpenAI server against the gateway, each
  given the same ``openai_load`` (the official client, N completions at once).
"""
