"""The client library: requests to Redis writes, and a job's events back (sync and asyncio)."""
