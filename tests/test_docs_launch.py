"""Every multi-process command the docs give for a machine without a GPU runs as written.

The commands are read from the docs' bash blocks (README.md, docs/*.md, examples/*/README.md),
so the docs and this test cannot drift: each 2-process ``torchrun`` or ``accelerate launch``
line with ``ACCELERATE_USE_CPU=1`` runs word for word, in ``bash``, after the ``VAR=value``
lines that come before it in the same file (``MODEL=$(python -c ...)``). It runs in a
directory laid out as the commands expect, with little in it, so that they are cheap:

- ``path/to/emotion`` and ``../shared/data/emotion``: ``TRAIN`` and ``EVAL`` emotion texts;
- ``bert-base-cased`` and ``Qwen/Qwen2.5-0.5B``: a tiny BERT and a tiny Llama (from configs,
  with the MiniLM tokenizer), which ``from_pretrained`` takes for the hub's, being local;
  ``tiny-llama``: what examples/sft/README.md's offline recipe makes, made by its own code;
- the scripts a doc says to save (``Save this as `train_emotion.py```), and ``train.py``: the
  doc's Python block before the command, after the README's names (``model``, ``tokenizer``,
  ``train_set``), which the docs' samples use;
- ``examples``: the repository's.

What each process trains is counted without touching the command: ``tests/scripts/count_rows``
on ``PYTHONPATH`` records the token rows of every training forward pass (see its docstring),
and every training text must be trained exactly once per epoch over the 2 processes, with
both processes training. The environment is the machine's: no hub, one thread a process, a
fresh ``HF_HOME`` whose accelerate config only picks a free port.

The same commands without ``ACCELERATE_USE_CPU=1`` (as the docs gave them before, issue 30)
must stop on both processes before any training step, with the error that names the fix.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "tests" / "scripts"))

from test_docs import Block, blocks  # noqa: E402

DOCS = [
    REPO / "README.md",
    *sorted(p for p in (REPO / "docs").glob("*.md") if p.name != "architecture.md"),
    *sorted((REPO / "examples").glob("*/README.md")),
]
COUNTER = REPO / "tests" / "scripts" / "count_rows"
TRAIN, EVAL = 40, 12
# The CPU commands each document gives: a command dropped from the docs, or one this test no longer
# finds, fails here rather than going untested.
EXPECTED = {
    "README.md": 1,
    "docs/restarts.md": 1,
    "docs/trainer.md": 3,
    "docs/trl.md": 1,
    "examples/emotion/README.md": 2,
    "examples/sft/README.md": 1,
}
# The README's names, for a doc's sample that uses them (docs/restarts.md, docs/trainer.md).
README_NAMES = """\
# The README's names (tests/test_docs_launch.py): a tiny BERT, its tokenizer, the emotion texts.
import datasets
from transformers import AutoModelForSequenceClassification, AutoTokenizer

tokenizer = AutoTokenizer.from_pretrained("bert-base-cased")
model = AutoModelForSequenceClassification.from_pretrained("bert-base-cased", num_labels=6)
train_set = datasets.load_dataset("json", data_files="path/to/emotion/train.jsonl", split="train").map(
    lambda rows: tokenizer(rows["text"], truncation=True, max_length=128), batched=True,
    remove_columns=["text"],
)
"""
ASSIGNMENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
# A line that only sets a variable: MODEL=$(python -c "..."), DATA=../shared/data/emotion  # comment
SETTING = re.compile(r"""[A-Za-z_][A-Za-z0-9_]*=(\$\(.*\)|"[^"]*"|'[^']*'|[^\s'"$]+)\s*(#.*)?""")


@dataclass(frozen=True)
class Launch:
    """A documented 2-process command, and the bash that runs it as written."""

    block: Block
    line: int  # the command's first line in its file, counted from 1
    command: str  # the line, continuations joined
    words: tuple[str, ...]
    setup: tuple[str, ...]  # the VAR=value lines before it in the same file

    def __str__(self) -> str:
        return f"{self.doc}:{self.line}"

    @property
    def doc(self) -> str:
        return str(self.block.path.relative_to(REPO))

    @property
    def cpu(self) -> bool:
        return "ACCELERATE_USE_CPU=1" in self.assignments

    @property
    def assignments(self) -> list[str]:
        words = list(self.words)
        return words[: next(i for i, word in enumerate(words) if not ASSIGNMENT.match(word))]

    @property
    def script(self) -> str:
        """The Python script the command starts (the first argument ending in .py)."""
        return next(word for word in self.words if word.endswith(".py"))


def lines(block: Block) -> list[tuple[int, str]]:
    """The lines of a bash block, each continuation joined to its line, with its line in the file."""
    found, number = [], block.line
    for line in block.code.replace("\\\n", "\\\x00").splitlines():
        found.append((number, line.replace("\\\x00", " ")))
        number += 1 + line.count("\\\x00")
    return found


def words_of(line: str) -> list[str]:
    lexer = shlex.shlex(line, posix=True)
    lexer.whitespace_split = True
    lexer.commenters = "#"
    return list(lexer)


def is_launch(words: list[str]) -> bool:
    """``torchrun --nproc_per_node 2 ...`` or ``accelerate launch ... --num_processes 2 ...``."""
    rest = [word for word in words if not ASSIGNMENT.match(word)]
    if rest[:1] == ["torchrun"]:
        flags = ("--nproc_per_node", "--nproc-per-node")
    elif rest[:2] == ["accelerate", "launch"]:
        flags = ("--num_processes",)
    else:
        return False
    return any(a in flags and b == "2" for a, b in itertools.pairwise(rest))


def launches() -> list[Launch]:
    found = []
    for doc in DOCS:
        setup: list[str] = []
        for block in blocks(doc):
            if block.lang != "bash":
                continue
            for number, line in lines(block):
                words = words_of(line)
                if SETTING.fullmatch(line.strip()):
                    setup.append(line.strip())
                elif words and is_launch(words):
                    found.append(Launch(block, number, line.strip(), tuple(words), tuple(setup)))
    return found


CPU_LAUNCHES = [launch for launch in launches() if launch.cpu]


def test_every_cpu_command_is_found_and_says_so() -> None:
    assert Counter(launch.doc for launch in CPU_LAUNCHES) == EXPECTED
    for launch in launches():
        comment = launch.command.partition("#")[2]
        # A command for CPUs without ACCELERATE_USE_CPU=1 trains alone on each process (issue 30).
        assert launch.cpu or "CPU" not in comment, f"{launch}: {launch.command}"


# -- running them ------------------------------------------------------------------------------


def distinct_rows(path: Path, count: int) -> list[str]:
    """The first ``count`` lines of ``path`` with distinct texts: each sample's token row is its own."""
    seen, kept = set(), []
    for line in path.read_text().splitlines(keepends=True):
        text = json.loads(line)["text"]
        if text not in seen:
            seen.add(text)
            kept.append(line)
        if len(kept) == count:
            return kept
    raise AssertionError(f"{path} has fewer than {count} distinct texts")


@pytest.fixture(scope="module")
def assets(tmp_path_factory: pytest.TempPathFactory, emotion_data_dir: Path, minilm_path: str) -> Path:
    """The data, the tiny models under the hub's names, made once for every command."""
    import torch
    import trl_common
    from transformers import AutoTokenizer, BertConfig, BertModel

    root = tmp_path_factory.mktemp("launch-assets")
    data = root / "emotion"
    data.mkdir()
    for split, count in (("train", TRAIN), ("validation", EVAL)):
        (data / f"{split}.jsonl").write_text(
            "".join(distinct_rows(emotion_data_dir / f"{split}.jsonl", count))
        )
    torch.manual_seed(0)
    config = BertConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=37, num_labels=6
    )
    BertModel(config).save_pretrained(root / "bert-base-cased")
    AutoTokenizer.from_pretrained(minilm_path).save_pretrained(root / "bert-base-cased")
    trl_common.save_tiny(root / "Qwen" / "Qwen2.5-0.5B", minilm_path, data, TRAIN)
    # examples/sft/README.md's offline recipe, as written, saves tiny-llama/ where it runs.
    (recipe,) = [block for block in blocks(REPO / "examples" / "sft" / "README.md") if block.lang == "python"]
    here = Path.cwd()
    os.chdir(root)
    try:
        exec(compile(recipe.code, str(recipe), "exec"), {"__name__": "__main__"})
    finally:
        os.chdir(here)
    assert (root / "tiny-llama" / "config.json").is_file()
    return root


def script_text(launch: Launch) -> str:
    """What the doc gives for the command's script: the block it says to save, or its sample before it.

    ``Save this as `sft_emotion.py``` names the first Python block after it; ``train.py`` is the
    doc's last Python block before the command, which uses the README's names.
    """
    path, script = launch.block.path, launch.script
    python = [block for block in blocks(path) if block.lang == "python"]
    text = path.read_text()
    saved = f"Save this as `{script}`"
    if saved in text:
        line = text[: text.index(saved)].count("\n") + 1
        return next(block for block in python if block.line > line).code
    assert script == "train.py", f"{launch}: the docs do not say what {script} is"
    return README_NAMES + "\n" + [block for block in python if block.line < launch.block.line][-1].code


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def workspace(root: Path, assets: Path, launch: Launch) -> Path:
    """A directory laid out as the command expects: its data, models and scripts, little of each."""
    work = root / "work"
    (work / "path" / "to").mkdir(parents=True)
    (work / "path" / "to" / "emotion").symlink_to(assets / "emotion")
    (root / "shared" / "data").mkdir(parents=True)
    (root / "shared" / "data" / "emotion").symlink_to(assets / "emotion")
    (work / "bert-base-cased").symlink_to(assets / "bert-base-cased")
    (work / "Qwen").symlink_to(assets / "Qwen")
    (work / "tiny-llama").symlink_to(assets / "tiny-llama")
    (work / "examples").symlink_to(REPO / "examples")
    if "/" not in launch.script:
        (work / launch.script).write_text(script_text(launch))
    accelerate = root / "hf" / "accelerate"
    accelerate.mkdir(parents=True)
    # accelerate launch's default port is 29500 whoever else holds it; this only picks a free one.
    config = f"compute_environment: LOCAL_MACHINE\ndistributed_type: 'NO'\nmain_process_port: {free_port()}\n"
    (accelerate / "default_config.yaml").write_text(config)
    (root / "rows").mkdir()
    return work


def run(root: Path, work: Path, bash: str) -> tuple[int, str, list[dict[str, Any]]]:
    """Run ``bash`` in ``work``; its exit status, output and the workers' counts (by rank)."""
    env = {
        **os.environ,
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
        "PYTHONPATH": os.pathsep.join([str(COUNTER), str(REPO), os.environ.get("PYTHONPATH", "")]),
        "TOKENBATCH_COUNT_ROWS": str(root / "rows"),
        "HF_HOME": str(root / "hf"),
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    child = subprocess.Popen(
        ["bash", "-e", "-c", bash],
        cwd=work,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:  # no timeout of its own: the suite's per-test limit is the bound against a hang
        output, _ = child.communicate()
    finally:
        if child.poll() is None:  # stopped by the per-test limit: the workers go too
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
    records = [json.loads(path.read_text()) for path in sorted((root / "rows").glob("*.json"))]
    workers = sorted((r for r in records if r["rank"] is not None), key=lambda r: int(r["rank"]))
    assert not [r for r in records if r["rank"] is None and r["rows"]], "a launcher trained"
    return child.returncode, output, workers


def epochs_of(launch: Launch, work: Path) -> int:
    """The epochs the command trains: its ``--num_epochs``, else its script's default."""
    words = list(launch.words)
    if "--num_epochs" in words:
        return int(words[words.index("--num_epochs") + 1])
    source = (work / launch.script).read_text()
    match = re.search(r'"--num_epochs", type=int, default=(\d+)', source) or re.search(
        r"\b(?:num_train_epochs|epochs)=(\d+)", source
    )
    assert match is not None, f"{launch}: how many epochs does {launch.script} train?"
    return int(match[1])


def training_rows(assets: Path) -> int:
    return len((assets / "emotion" / "train.jsonl").read_text().splitlines())


@pytest.mark.slow
@pytest.mark.parametrize("launch", CPU_LAUNCHES, ids=str)
def test_the_command_trains_every_text_once_per_epoch(launch: Launch, assets: Path, tmp_path: Path) -> None:
    work = workspace(tmp_path, assets, launch)
    returncode, output, workers = run(tmp_path, work, "\n".join([*launch.setup, launch.command]))
    assert returncode == 0, f"{launch}: {launch.command}\n{output[-6000:]}"
    assert [int(worker["rank"]) for worker in workers] == [0, 1], output[-3000:]
    assert all(worker["rows"] for worker in workers), "a process trained nothing"
    trained = Counter(tuple(row) for worker in workers for row in worker["rows"])
    assert len(trained) == training_rows(assets), "some texts were never trained"
    epochs = epochs_of(launch, work)
    # 2 * epochs for every text: each process trained every sample alone.
    assert set(trained.values()) == {epochs}, Counter(trained.values())


REFUSED = "num_processes should be torch.distributed's world size 2, but accelerate got num_processes=1"


@pytest.mark.slow
@pytest.mark.parametrize("doc", ["docs/trainer.md", "docs/restarts.md"])
def test_without_accelerate_use_cpu_every_process_stops_before_a_step(
    doc: str, assets: Path, tmp_path: Path
) -> None:
    """The docs' torchrun lines as they were: accelerate trains alone on each CPU process.

    Without ``--max-restarts``: every attempt torchrun would make refuses alike, once is enough.
    """
    launch = next(launch for launch in CPU_LAUNCHES if launch.doc == doc and "torchrun" in launch.words)
    command = re.sub(r" --max-restarts \d+", "", launch.command.replace("ACCELERATE_USE_CPU=1 ", ""))
    assert "torchrun" in command and "ACCELERATE_USE_CPU" not in command and "restarts" not in command
    work = workspace(tmp_path, assets, launch)
    returncode, output, workers = run(tmp_path, work, command)
    assert returncode != 0, output[-3000:]
    assert [int(worker["rank"]) for worker in workers] == [0, 1], output[-3000:]
    for worker in workers:
        assert worker["rows"] == [], "a training step ran before the refusal"
        assert worker["error"].startswith(f"RuntimeError: {REFUSED}"), worker["error"]
        assert "set ACCELERATE_USE_CPU=1" in worker["error"]
