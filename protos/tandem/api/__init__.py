"""Tandem's client API (package tandem.api)."""
