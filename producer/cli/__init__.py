"""The ``tokenfleet`` command line: every command; worker-side ones import the worker lazily."""
