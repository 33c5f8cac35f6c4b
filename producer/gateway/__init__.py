"""The HTTP gateway: the only code that speaks HTTP (app, routes, auth, rate limits, SSE, timeouts)."""
