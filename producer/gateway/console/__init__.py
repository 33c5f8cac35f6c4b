"""The console: the fleet, its queues, jobs, batches and dead letters in a
browser, served by the gateway at ``/console`` (docs/console.md).

Rendered on the server (Jinja2 templates, plain ``fetch`` and ``EventSource``
for the live parts, every asset in the wheel), reading only what the fleet
keeps; every page answers JSON too, for ``Accept: application/json``.
"""
