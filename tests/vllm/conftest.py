"""The storage servers of tests/segments (an LMCache lm:// server process, Redis) for vLLM tests."""

from tests.segments.conftest import lm_server, redis_server

__all__ = ["lm_server", "redis_server"]
