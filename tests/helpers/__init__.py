"""Helpers shared by tests in several folders (import them as ``tests.helpers.<module>``)."""
