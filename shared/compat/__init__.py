"""Shims over dependencies' non-public APIs, one module per dependency.

Everything here reaches into something a dependency does not document (a
private attribute, a class to subclass, an error text). Keeping each such
reach in one place, with a test of its own run on the lowest and newest
versions ``pyproject.toml`` allows, means a dependency's release that moves it
breaks one shim and one test, not the fleet.
"""
