"""The package's shape, checked: layers import downwards only, nobody reads call stacks, one upstream adapter.

``docs/architecture.md`` draws these layers; this test is what keeps the
drawing true. A module may import from its own layer or a lower one, never
from a higher one, and the imports between tokenbatch's modules form no
circle. Nothing in ``tokenbatch/`` inspects its callers' frames, and what is
read of other libraries' private attributes is read in
``tokenbatch/integrations/_upstream.py`` only.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "tokenbatch"

# Lowest first. A module's layer is that of the longest prefix listed.
LAYERS = [
    ["tokenbatch._checks", "tokenbatch._distributed", "tokenbatch._accelerate"],
    ["tokenbatch.cost", "tokenbatch._lr", "tokenbatch.lengths", "tokenbatch._packs"],
    ["tokenbatch.plan", "tokenbatch.testing"],
    ["tokenbatch.sampler", "tokenbatch.stream", "tokenbatch.compare"],
    ["tokenbatch.oom"],
    ["tokenbatch.probe"],
    ["tokenbatch"],  # the package's __init__: the public names
    ["tokenbatch.integrations", "tokenbatch.cli"],
    ["tokenbatch.__main__"],
]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def layer_of(module: str) -> int:
    best, depth = -1, -1
    for number, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > depth:
                best, depth = number, len(prefix)
    assert best >= 0, f"{module} is in no layer: add it to LAYERS (and to docs/architecture.md)"
    return best


def imports(path: Path) -> set[str]:
    """The tokenbatch modules ``path`` imports (at run time or for type checking)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("tokenbatch"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tokenbatch"):
            for alias in node.names:  # `from tokenbatch import _lr` names a module; `from x import Name` not
                candidate = f"{node.module}.{alias.name}"
                exists = (PACKAGE.parent / candidate.replace(".", "/")).with_suffix(".py").exists() or (
                    PACKAGE.parent / candidate.replace(".", "/") / "__init__.py"
                ).exists()
                found.add(candidate if exists else node.module)
    return found


SOURCES = sorted(PACKAGE.rglob("*.py"))
GRAPH = {module_name(path): imports(path) - {module_name(path)} for path in SOURCES}


def test_layers_import_downwards_only() -> None:
    upward = [
        f"{module} (layer {layer_of(module)}) imports {target} (layer {layer_of(target)})"
        for module, targets in GRAPH.items()
        for target in targets
        if layer_of(target) > layer_of(module)
    ]
    assert upward == []


def test_no_module_imports_form_a_circle() -> None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(GRAPH.get(module, ())):
            if target not in GRAPH:
                continue
            assert state.get(target) != 1, " -> ".join([*path, module, target])
            if state.get(target) is None:
                visit(target, [*path, module])
        state[module] = 2

    for module in sorted(GRAPH):
        if module not in state:
            visit(module, [])


def test_nothing_inspects_its_callers_frames() -> None:
    pattern = re.compile(r"sys\._getframe|\.f_back\b|inspect\.(stack|currentframe|getouterframes)")
    found = [f"{p.relative_to(PACKAGE)}" for p in SOURCES if pattern.search(p.read_text())]
    assert found == []


def test_other_libraries_private_attributes_are_read_in_one_adapter() -> None:
    """The names ``_upstream.py`` exists for appear nowhere else in the package."""
    adapter = PACKAGE / "integrations" / "_upstream.py"
    names = (
        "_prepare_inputs|_get_collator_with_removed_columns|_loss_shifts_labels|_accelerator_connector"
        "|_combined_loader|_filters_mutated|_models|_num_yielded|_index_sampler|_sampler_iter"
        "|_prefetch_factor|_num_workers"
    )
    upstream = re.compile(rf"""[.'"](?:{names})\b""")  # an attribute read, or getattr(obj, "_name")
    found = [
        f"{p.relative_to(PACKAGE)}: {match.group(0)}"
        for p in SOURCES
        if p != adapter
        for match in upstream.finditer(p.read_text())
    ]
    assert found == []
    assert all(name in adapter.read_text() for name in ("_prepare_inputs", "_accelerator_connector"))


def test_no_code_is_packed_against_the_formatter() -> None:
    marker = "fmt: " + "skip"  # spelled apart, so that this file does not find itself
    folders = ("tokenbatch", "tests", "benchmarks", "examples")
    files = [p for folder in folders for p in sorted((PACKAGE.parent / folder).rglob("*.py"))]
    found = [str(p.relative_to(PACKAGE.parent)) for p in files if marker in p.read_text()]
    assert found == []
