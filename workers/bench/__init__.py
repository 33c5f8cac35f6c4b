"""``tokenfleet bench``: the fleet side by side with the model's own batched speed.

- ``workload``: the jobs every mode runs (prompts, lengths, arrival times) and
  how a run's timings become figures;
- ``procs``: the processes a run needs (a redis-server, Celery workers);
- ``modes``: direct, fleet, naive Celery and overhead, each one run;
- ``naive_app``: the Celery app of the naive pattern (a task per prompt);
- ``run``: the whole benchmark, its table, JSON and plot.
"""
