"""The worker side: Celery app, engine, scheduler, model runners, GPU pinning."""
