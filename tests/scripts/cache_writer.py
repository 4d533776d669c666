"""A process that stores many budgets in one shared cache (spawned by tests/test_budget_cache.py)."""

from __future__ import annotations

from typing import Any

from tokenbatch.probe import BudgetCache, BudgetKey


def write_budgets(path: str, worker: int, count: int, start: Any) -> None:
    """Store ``count`` budgets under keys of this worker's own, as fast as it can."""
    cache = BudgetCache(path)
    start.wait(timeout=120)  # every worker begins together, so their writes overlap
    for i in range(count):
        cache.put(BudgetKey(f"model-{worker}-{i}", "cpu:test", 2**30, "float32", 1), 64 + i, source="oom")
