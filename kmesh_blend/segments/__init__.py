"""Shared segments: annotation, content identity, the round-aware index and its storage."""
