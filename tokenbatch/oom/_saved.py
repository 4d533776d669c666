"""The guard's saved state: its budget, events and growth bracket, version 2 (version 1 still read).

Version 1 (before growth) held ``version``, ``mode``, ``max_tokens`` and
``events``; version 2 adds ``growth``: the bracket (so a resumed run does not
try a budget that failed again) and the growth events, or None without growth.
"""

from __future__ import annotations

from typing import Any

from tokenbatch import _checks
from tokenbatch.oom._events import OOMEvent

VERSION = 2
KEYS = {
    1: {"version", "mode", "max_tokens", "events"},
    2: {"version", "mode", "max_tokens", "events", "growth"},
}


def guard_state(
    mode: str, max_tokens: float, events: list[OOMEvent], growth: dict[str, Any] | None
) -> dict[str, Any]:
    """The ``OOMFallback.state_dict()`` for these fields."""
    return {
        "version": VERSION,
        "mode": mode,
        "max_tokens": max_tokens,
        "events": [event.as_dict() for event in events],
        "growth": growth,
    }


def read_guard_state(state: Any, mode: str) -> tuple[float, list[OOMEvent], Any]:
    """The budget, events and growth state (None: none saved) of a guard's state; every field checked.

    Raises:
        TypeError, ValueError: the state is not an ``OOMFallback.state_dict()`` of
            version 1 or 2 for ``mode``, or a field is wrong; the message names it.
    """
    version = state.get("version") if isinstance(state, dict) else None
    if version not in KEYS or set(state) != KEYS[version]:
        raise ValueError(
            f"state should be an OOMFallback.state_dict() (version 2, keys {sorted(KEYS[2])}; or "
            f"version 1), but got {state!r:.200}"
        )
    if state["mode"] != mode:  # a halve-mode budget is the sampler's, not a micro-batch one
        raise ValueError(
            f"state['mode'] should be {mode!r}, this fallback's mode, but got "
            f"state['mode']={state['mode']!r}; resume with OOMFallback(..., mode={state['mode']!r})"
        )
    max_tokens = _checks.positive_number("state['max_tokens']", state["max_tokens"])
    saved = state["events"]
    if not isinstance(saved, list | tuple):
        raise TypeError(f"state['events'] should be a list, but got state['events']={saved!r:.100}")
    events = [OOMEvent.from_dict(e, name=f"state['events'][{i}]") for i, e in enumerate(saved)]
    return max_tokens, events, state.get("growth")
