"""Batches: their records in Redis, the driver that runs them, their lines and output files."""
