"""The ``tokenbatch plan --plot`` picture: batch size against the batch's longest sequence."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tokenbatch.sampler import TokenBudgetBatchSampler


def plot_plan(sampler: TokenBudgetBatchSampler, path: Path, fixed_batch_size: int | None = None) -> None:
    """Draw each planned batch as a point, the budget as a curve, and a fixed batch size as a line."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("--plot needs matplotlib: pip install matplotlib") from None
    plan = sampler.plan
    longest = plan.batch_longest(sampler.lengths)
    figure, axes = plt.subplots(figsize=(7, 4.5))
    axes.scatter(longest, plan.batch_sizes(), s=12, alpha=0.7, label="tokenbatch batches")
    grid = np.unique(np.linspace(1, sampler.lengths.max(), 400).astype(int))
    axes.plot(grid, sampler.max_tokens / sampler.cost.sample_cost(grid), "k--", lw=1, label="budget limit")
    if fixed_batch_size is not None:
        axes.axhline(fixed_batch_size, color="tab:red", lw=1, label=f"fixed batch size {fixed_batch_size}")
    axes.set(xlabel="longest sequence in the batch (tokens)", ylabel="sequences in the batch", yscale="log")
    axes.set_title(f"{plan.num_batches} batches under max_tokens={sampler.max_tokens:g}")
    axes.legend()
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
