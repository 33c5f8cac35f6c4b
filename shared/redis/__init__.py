"""Reaching Redis: connections that ride out restarts and failovers, URLs, pools, the fleet's clock and liveness."""
