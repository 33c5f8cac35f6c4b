"""Pieces both sides of the fleet share: wire types, settings, Redis keys and scripts, models."""
