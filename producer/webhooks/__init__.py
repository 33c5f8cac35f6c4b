"""Webhooks: each tenant's lane of events, signed and posted until they land."""
