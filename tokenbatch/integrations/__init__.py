"""Glue between tokenbatch and training frameworks.

Each integration is its own module, imported on demand, so that
``import tokenbatch`` never pulls in a framework:

- :mod:`tokenbatch.integrations.accelerate`: helpers for your own accelerate
  loop: gathering evaluation batches of uneven sizes, a progress bar that
  follows re-plans, a clean shutdown, and the model's cost in token units.
- :mod:`tokenbatch.integrations.transformers`: :class:`TokenBudgetTrainer`, a
  transformers ``Trainer`` that batches by token budget and survives
  out-of-memory errors without restarting the run; ``TokenBudgetMixin``, the
  same for any ``Trainer`` subclass.
- :mod:`tokenbatch.integrations.trl`: :class:`TokenBudgetSFTTrainer`, TRL's
  ``SFTTrainer`` with the same token budget and guard.
- :mod:`tokenbatch.integrations.lightning`: :class:`TokenBudgetCallback`, which
  shards the sampler across Lightning's processes and starts each epoch's plan,
  and ``oom_fallback`` for manual optimisation.
"""
