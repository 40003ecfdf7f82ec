"""The optimizer's memory: deployments, rounds, gaps, directions, candidates, validations, mechanisms and
events in one SQLite file (schema/ holds its migrations)."""

from specpilot.memory.store import DEFAULT_PATH, Memory, MemoryStoreError

__all__ = ["DEFAULT_PATH", "Memory", "MemoryStoreError"]
