"""Short readings of the benchmark numbers for RESULTS.md, written from the numbers.

Each reader turns one benchmark's JSON into a few sentences, so the page
stays true when the benchmarks are run again on another machine.
"""

from __future__ import annotations

from typing import Any

from benchmarks import common


def _span(rows: list[dict[str, Any]], method: str, key: str) -> str:
    values = [r[key] for r in rows if r["method"] == method]
    return f"{min(values):.3g}..{max(values):.3g}" if values else "n/a"


def read_padding(data: dict[str, Any]) -> str:
    rows = data["rows"]
    one = [r for r in rows if r["processes"] == 1]
    two = [r for r in rows if r["processes"] == 2]

    def span1(method: str, key: str) -> str:
        return _span(one, method, key)

    def span2(method: str, key: str) -> str:
        return _span(two, method, key)

    lines = []
    synthetic = [name for name, d in data["datasets"].items() if d["source"].startswith("SYNTHETIC")]
    if synthetic:
        lines.append(f"**No real data was found: {', '.join(synthetic)} are synthetic stand-ins.**\n")
    for t in data["targets"]:
        lower, fewest = t["lower_bound_steps"], t["fewest_possible_steps"]
        verdict = "met" if t["efficiency_met"] and t["steps_met"] else "NOT met"
        text = (
            f"- Target {t['target']}: {verdict}. Efficiency {t['tokenbatch_efficiency']:.4f} "
            f"(need >= {t['min_efficiency']}; sorted greedy {t['sorted_greedy_efficiency']:.4f}); "
            f"{t['tokenbatch_steps']:g} steps = {t['tokenbatch_steps_over_lower_bound']:.4f} x the lower "
            f"bound of {lower:.2f} (need <= {t['max_steps_over_lower_bound']})."
        )
        if fewest / lower > t["max_steps_over_lower_bound"]:
            text += (
                f" No batching can meet the steps target here: the sorted greedy pass needs {fewest:g} "
                f"batches, and it uses the fewest possible (an exchange argument: some optimal batching "
                f"takes the longest samples together, and greedy is optimal along a sorted order), "
                f"so the best reachable ratio is {fewest / lower:.4f}."
            )
        lines.append(text)
    greedy = {(r["dataset"], r["cost"], r["budget"]): r for r in one if r["method"] == "sorted_greedy"}
    ours = [r for r in one if r["method"] == "tokenbatch"]
    lines.append(
        f"- Over every data set, cost and budget (1 process), padding efficiency is "
        f"{span1('tokenbatch', 'efficiency')} for tokenbatch and {span1('sorted_greedy', 'efficiency')} "
        f"for the sorted greedy reference, against {span1('length_grouped', 'efficiency')} for "
        f"LengthGroupedSampler and {span1('random_fixed', 'efficiency')} for random fixed batches. "
        f"Steps / lower bound: tokenbatch {span1('tokenbatch', 'steps_over_lower_bound')}, "
        f"LengthGroupedSampler and random fixed batches {span1('random_fixed', 'steps_over_lower_bound')}: "
        f"a fixed batch size sized for the longest sample leaves most of the budget unused "
        f"(mean budget use {span1('length_grouped', 'mean_budget_use')} for LengthGroupedSampler)."
    )
    ones = sorted({f"{r['dataset']}/{r['cost']}/{r['budget']}" for r in one if r["batch_size"] == 1})
    if ones:
        lines.append(
            f"- Where the longest sample forces a fixed batch size of 1 ({', '.join(ones)}), the fixed-size "
            f"methods pad nothing (efficiency 1) but take one step per sample."
        )
    if ours:
        worst = max(ours, key=lambda r: r["steps"] / greedy[(r["dataset"], r["cost"], r["budget"])]["steps"])
        reference = greedy[(worst["dataset"], worst["cost"], worst["budget"])]["steps"]
        lines.append(
            f"- tokenbatch's step count is within {worst['steps'] / reference - 1:.1%} of the sorted greedy "
            f"pass's everywhere (worst: {worst['dataset']}, {worst['cost']}, budget {worst['budget']}: "
            f"{worst['steps']:.3g} steps against {reference:g}, averaged over epochs). The random budget "
            f"share of its first batch, which moves batch boundaries between epochs, can cost one batch; "
            f"that shows only when an epoch has few steps."
        )
        mean_repetition = sum(r["repetition"] for r in ours) / len(ours)
        lines.append(
            f"- Batch-mate repetition between consecutive epochs: tokenbatch "
            f"{span1('tokenbatch', 'repetition')} (mean {mean_repetition:.2f}), LengthGroupedSampler "
            f"{span1('length_grouped', 'repetition')}, random batches {span1('random_fixed', 'repetition')}, "
            f"sorted greedy 1 (the same batches every epoch). Tight length grouping keeps a sample among "
            f"the few others of nearly its length, so many of its batch-mates come back next epoch; "
            f"only the tie-breaks, the boundaries and the batch order change."
        )
    same = all(r["lgs_own_fit_batch_size"] == r["batch_size"] for r in one if r["method"] == "length_grouped")
    lines.append(
        "- LengthGroupedSampler's own worst batch allows "
        + (
            "no larger batch size than the seed's in any row (it puts the longest sample first, in a full "
            "batch), so one row per budget serves both readings."
            if same
            else "a larger batch size in some rows: see the `length_grouped_own_fit` rows."
        )
    )
    if two:
        lines.append(
            f"- 2 processes: tokenbatch step balance (mean batch cost / the step's costliest batch) "
            f"{span2('tokenbatch', 'step_balance')}, steps / lower bound "
            f"{span2('tokenbatch', 'steps_over_lower_bound')}; LengthGroupedSampler's balance "
            f"{span2('length_grouped', 'step_balance')}, random batches "
            f"{span2('random_fixed', 'step_balance')}."
        )
    return "\n".join(lines)


def read_planning(data: dict[str, Any]) -> str:
    t = data["target"]
    rows, last = data["rows"], data["rows"][-1]
    trend = ", ".join(f"{r['first_plan_peak_bytes_per_sample']:.1f} at {r['n']:.0e}" for r in rows)
    text = (
        f"Planning {t['n']:,} lengths: building the sampler and planning the first epoch takes "
        f"{last['first_plan_s']:.2f} s = {t['first_over_argsort']:.2f}x numpy.argsort on the same array, "
        f"each later epoch {last['epoch_plan_s']:.2f} s = {t['epoch_over_argsort']:.2f}x (goal <= "
        f"{t['max_ratio']:g}x: {'met' if t['met'] else 'NOT met'}). Peak traced memory is about "
        f"{last['first_plan_peak_bytes_per_sample']:.0f} bytes per sample (the input is "
        f"{last['input_bytes_per_sample']} bytes per sample, kept as it is), against "
        f"{last['argsort_peak_bytes_per_sample']:.0f} for argsort's result"
    )
    if "bytes_met" in t:
        text += f" (goal <= {t['max_bytes_per_sample']:g}: {'met' if t['bytes_met'] else 'NOT met'})"
    return (
        text + f". Bytes per sample by size: {trend}; the chunks the planner's loops work in (2^16 samples) "
        f"weigh on the smaller sizes. At 10^4 lengths fixed per-call overheads dominate and the ratio is "
        f"larger, but the time is milliseconds."
    )


def read_gpu(data: dict[str, Any]) -> str:
    """What ran and what was skipped; the numbers are in the sections' tables below."""
    if data.get("skipped"):
        return f"Skipped: {data.get('reason', 'no CUDA device')}."
    sections = data.get("sections", [])
    ran = [s["name"] for s in sections if s.get("status") == "ok"]
    skipped = [f"{s['name']} ({s.get('reason', '?')})" for s in sections if s.get("status") != "ok"]
    device = (data.get("machine") or {}).get("cuda") or data.get("device", "?")
    return (
        f"On {device}{' (TINY models, not figures)' if data.get('tiny') else ''}: {len(ran)} section(s) "
        f"measured" + (f"; skipped: {'; '.join(skipped)}" if skipped else "") + "."
    )


def read_ddp_overlap(data: dict[str, Any]) -> str:
    """The guard's step time against plain DDP's, per model and path."""
    rows = [r for r in data.get("rows", []) if r.get("arm") != "plain DDP"]
    parts = [f"{r['model']}, {r['arm']}: {r['vs plain DDP']:.3f}x plain DDP's step time" for r in rows]
    return "; ".join(parts) + "." if parts else "No rows."


def read_lhotse(data: dict[str, Any]) -> str:
    """tokenbatch against lhotse's DynamicBucketingSampler: each figure's span, and where lhotse wins."""
    rows = data["rows"]

    def span(method: str, key: str, ranks: int = 1, mode: str | None = None) -> str:
        chosen = [r for r in rows if r["ranks"] == ranks and (mode is None or r["mode"] == mode)]
        return _span_of([r[key] for r in chosen if r["method"] == method])

    def worst(method: str, key: str) -> float:
        return max(r[key] for r in rows if r["method"] == method)

    ratios = {
        mode: [r["lhotse_time_ratio"] for r in rows if r["mode"] == mode and "lhotse_time_ratio" in r]
        for mode in ("map-style", "stream")
    }
    pairs = {(r["dataset"], r["mode"], r["ranks"], r["method"]): r for r in rows}
    wins = []
    for (dataset, mode, ranks, method), ours in pairs.items():
        if method != "tokenbatch":
            continue
        theirs = pairs[dataset, mode, ranks, "lhotse"]
        where = f"{dataset} {mode}" + (f" {ranks} ranks" if ranks > 1 else "")
        for key, label, lower_is_better in (
            ("steps_over_lower_bound", "steps / lower bound", True),
            ("efficiency", "padding efficiency", False),
            ("peak_mib", "stream buffer peak MiB", True),
            ("step_balance", "step balance", False),
        ):
            if key not in ours or (key == "step_balance" and ranks == 1):
                continue
            if (theirs[key] < ours[key]) if lower_is_better else (theirs[key] > ours[key]):
                wins.append(f"{label} on {where} ({theirs[key]:.3g} against {ours[key]:.3g})")
    buffer = data.get("buffer", "?")
    peaks = span("tokenbatch", "peak_mib", mode="stream"), span("lhotse", "peak_mib", mode="stream")
    lines = [
        f"On the same cost and budgets (lhotse {data.get('lhotse', '?')}, 1 rank): steps / lower bound "
        f"{span('tokenbatch', 'steps_over_lower_bound')} for tokenbatch against "
        f"{span('lhotse', 'steps_over_lower_bound')} for lhotse; padding efficiency "
        f"{span('tokenbatch', 'efficiency')} against {span('lhotse', 'efficiency')}. On 1 or 2 ranks the "
        f"costliest batch is {worst('tokenbatch', 'max_budget_use'):.3g} x the budget for tokenbatch and "
        f"{worst('lhotse', 'max_budget_use'):.3g} x for lhotse, with up to "
        f"{worst('lhotse', 'over_budget'):.1%} of lhotse's batches over it.",
        f"An epoch of the map-style sampler takes 1/{_span_of(ratios['map-style'])} of lhotse's time "
        f"(lhotse holding the whole set), the stream at buffer {buffer:,} passes examples "
        f"{_span_of(ratios['stream'])}x as fast; stream buffer peak {peaks[0]} MiB against {peaks[1]} MiB.",
        "Where lhotse does better: " + ("; ".join(wins) if wins else "nowhere in this run") + ".",
    ]
    return "\n\n".join(lines)


def read_packing(data: dict[str, Any]) -> str:
    """Padding-free batchings side by side: fill, truncation, steps, balance and speed, per data set."""
    rows = [r for r in data["rows"] if "skipped" not in r]
    lines = []
    synthetic = [name for name, d in data["datasets"].items() if d["source"].startswith("SYNTHETIC")]
    if synthetic:
        lines.append(f"**Synthetic stand-ins, not the real data: {', '.join(synthetic)}.**")
    for name, info in data["datasets"].items():
        one = {r["method"]: r for r in rows if r["dataset"] == name and r["processes"] == 1}
        two = {r["method"]: r for r in rows if r["dataset"] == name and r["processes"] == 2}
        ours, bfd = one.get("tokenbatch_packed"), one.get("trl_bfd")
        if ours is None:
            continue
        text = (
            f"- {name} (B={info['budget']}): tokenbatch's packs fill {ours['fill']:.3f} of the budget in "
            f"{ours['steps']} steps, padded batches {one['tokenbatch_padded']['fill']:.3f}"
        )
        if bfd is not None:
            text += (
                f"; TRL's bfd {bfd['fill']:.3f} in {bfd['steps']} steps, truncating "
                f"{bfd['truncated']:.2%} of the tokens, the same packs every epoch"
            )
        fixed = one.get("trl_padding_free")
        if fixed is not None:
            text += f"; a fixed count ({fixed['batch']}) fills {fixed['fill']:.3f} in {fixed['steps']} steps"
        packed2 = two.get("tokenbatch_packed")
        if packed2 is not None:
            others = [
                f"{m} {r['balance_L2']:.3g}"
                for m, r in two.items()
                if m != "tokenbatch_packed" and "balance_L2" in r
            ]
            text += (
                f". On 2 ranks, the largest rank's attention work over the mean: {packed2['balance_L2']:.3g} "
                f"for tokenbatch (tokens {packed2['balance_L']:.3g}), against " + ", ".join(others)
            )
        speeds = {m: r["tokens_per_s"] for m, r in two.items() if "tokens_per_s" in r}
        if speeds and "tokenbatch_packed" in speeds:
            best = max(speeds, key=speeds.get)  # type: ignore[arg-type]
            text += (
                f". Training on CPU (2 processes): {speeds['tokenbatch_packed']:,.0f} real tokens/s packed, "
                f"{speeds.get('tokenbatch_padded', float('nan')):,.0f} padded; fastest {best}"
            )
        lines.append(text + ".")
    return "\n".join(lines)


def _span_of(values: list[float]) -> str:
    if not values:
        return "n/a"
    low, high = f"{min(values):.3g}", f"{max(values):.3g}"
    return low if low == high else f"{low}..{high}"


READERS = {"padding": read_padding, "planning": read_planning, "gpu": read_gpu}
READERS["ddp_overlap"] = read_ddp_overlap
READERS["lhotse_compare"] = read_lhotse
READERS["packing"] = read_packing


def headline(results: dict[str, dict[str, Any]]) -> str:
    """The few numbers a reader wants first: issue 2's two settings, every method side by side."""
    if "padding" not in results:
        return ""
    names = {
        "tokenbatch": "tokenbatch",
        "random_fixed": "random fixed batches (seed)",
        "length_grouped": "transformers LengthGroupedSampler",
        "sorted_greedy": "sorted greedy (no randomness)",
    }
    table = []
    for t in results["padding"]["targets"]:
        dataset, cost_name, budget = t["target"].split(", ")
        for row in results["padding"]["rows"]:
            key = (row["dataset"], row["cost"], f"max_tokens={row['budget']}", row["processes"])
            if key == (dataset, cost_name, budget, 1) and row["method"] in names:
                table.append(
                    {
                        "setting": t["target"],
                        "method": names[row["method"]],
                        "batch size": "from budget" if row["batch_size"] == "budget" else row["batch_size"],
                        "padding efficiency": row["efficiency"],
                        "steps / lower bound": row["steps_over_lower_bound"],
                        "batch-mate repetition": row["repetition"],
                    }
                )
    text = "## Headline\n\n" + common.markdown_table(
        table, list(table[0]) if table else ["setting"], digits=4
    )
    if "planning" in results:
        t = results["planning"]["target"]
        text += (
            f"\n\nPlanning {t['n']:,} lengths: {t['first_over_argsort']:.2f}x numpy.argsort for the first "
            f"epoch (sampler construction included), {t['epoch_over_argsort']:.2f}x for each later one."
        )
    return text + "\n"
