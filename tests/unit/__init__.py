"""The unit layer: the pool and the session against an in-memory fake runtime (seconds)."""
