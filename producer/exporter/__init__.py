"""Prometheus exporters read from Redis (``tokenfleet metrics-exporter``)."""
