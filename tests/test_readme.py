"""README.md's first code sample runs as written."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_first_look_sample_runs() -> None:
    section = README.read_text().split("## A first look", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S)
    assert code is not None
    namespace: dict[str, object] = {}
    exec(compile(code.group(1), str(README), "exec"), namespace)
    sampler = namespace["sampler"]
    loader = namespace["loader"]
    assert len(loader) == len(list(loader)) > 0  # type: ignore[arg-type]
    assert sampler.stats().padding_efficiency > 0.9  # type: ignore[attr-defined]
