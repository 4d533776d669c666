"""Kept so that ``tokenbatch.budget_cache`` imports keep working: the cache lives in the probe."""

from tokenbatch.probe._cache import BudgetCache, BudgetKey, default_path, remember_budget

__all__ = ["BudgetCache", "BudgetKey", "default_path", "remember_budget"]
