"""Quick benchmark runs write elsewhere: they never overwrite the committed results unless asked."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # benchmarks/ is not part of the installed package
    sys.path.insert(0, str(REPO))

from benchmarks import __main__ as suite  # noqa: E402
from benchmarks import common, gpu  # noqa: E402


def committed() -> dict[Path, tuple[int, bytes]]:
    """Modification time and bytes of benchmarks/RESULTS.md and every file in benchmarks/results."""
    paths = [
        REPO / "benchmarks" / "RESULTS.md",
        *(common.RESULTS.iterdir() if common.RESULTS.is_dir() else []),
    ]
    return {path: (path.stat().st_mtime_ns, path.read_bytes()) for path in paths if path.is_file()}


def test_quick_runs_default_to_their_own_folder(tmp_path: Path) -> None:
    assert common.output_folder(None, quick=False) == common.RESULTS
    assert common.output_folder(None, quick=True) == common.QUICK_RESULTS != common.RESULTS
    assert common.output_folder(tmp_path, quick=True) == tmp_path
    assert common.output_folder(common.RESULTS, quick=True) == common.RESULTS  # asked for explicitly


@pytest.mark.parametrize(
    ("argv", "expected"),
    [([], "results"), (["--quick"], "quick"), (["--quick", "--out", "elsewhere"], "elsewhere")],
)
def test_each_benchmark_parser_resolves_out(argv: list[str], expected: str) -> None:
    want = {"results": common.RESULTS, "quick": common.QUICK_RESULTS, "elsewhere": Path("elsewhere")}[
        expected
    ]
    parser = common.parser("gpu", "a benchmark")
    parser.add_argument("--device", default="cuda")  # a module's own options do not change it
    assert parser.parse_args(argv).out == want
    assert parser.parse_known_args([*argv, "--extra"])[0].out == want


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_the_quick_folder_is_ignored_by_git() -> None:
    inside = subprocess.run(["git", "rev-parse"], cwd=REPO, capture_output=True, check=False)
    if inside.returncode != 0:
        pytest.skip("not a git checkout")
    path = common.QUICK_RESULTS.relative_to(REPO) / "padding.json"
    assert subprocess.run(["git", "check-ignore", "-q", str(path)], cwd=REPO, check=False).returncode == 0


def test_a_quick_module_run_leaves_the_committed_results_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(common, "QUICK_RESULTS", tmp_path / "quick")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the GPU benchmark's quick skip path
    before = committed()
    assert gpu.main(["--quick"]) == 0
    assert (tmp_path / "quick" / "gpu.json").is_file() and (tmp_path / "quick" / "gpu.md").is_file()
    assert committed() == before


def test_the_quick_suite_writes_results_and_page_elsewhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    quick = tmp_path / "quick"
    monkeypatch.setattr(common, "QUICK_RESULTS", quick)
    commands: list[list[str]] = []
    pages: list[list[str]] = []

    def run(command: list[str], **_: Any) -> SimpleNamespace:
        commands.append(command)
        return SimpleNamespace(returncode=0)

    monkeypatch.setattr(suite, "subprocess", SimpleNamespace(run=run))
    monkeypatch.setattr(suite.report, "main", pages.append)
    before = committed()

    assert suite.main(["--quick", "--only", "padding"]) == 0
    # The module resolves the same default itself, so the recorded command stays portable.
    assert commands[-1][1:] == ["-m", "benchmarks.padding", "--quick"]
    assert pages[-1] == ["--results", str(quick.resolve()), "--output", str(quick.resolve() / "RESULTS.md")]

    mine = tmp_path / "mine"
    assert suite.main(["--quick", "--out", str(mine), "--only", "padding"]) == 0
    assert commands[-1][-2:] == ["--out", str(mine.resolve())]
    assert pages[-1][-1] == str(mine.resolve() / "RESULTS.md")

    assert suite.main(["--only", "padding"]) == 0  # a full run still writes the committed page
    assert commands[-1][1:] == ["-m", "benchmarks.padding"]
    assert pages[-1] == [
        "--results",
        str(common.RESULTS.resolve()),
        "--output",
        str(suite.HERE / "RESULTS.md"),
    ]
    assert committed() == before
