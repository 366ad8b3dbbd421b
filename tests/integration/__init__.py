"""Integration tests: the HTTP server against an engine (fake by default, see conftest.py)."""
