"""Helpers for tests and demos: tiny local models built from scratch (no model hub)."""
