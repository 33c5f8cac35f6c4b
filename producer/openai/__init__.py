"""OpenAI's API in the fleet's terms: its shapes, errors and the one mapping to and from requests; no HTTP here."""
