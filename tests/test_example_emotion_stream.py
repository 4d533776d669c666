"""examples/emotion/stream.py end to end: a tiny BERT streaming an emotion slice, 1 and 2 processes.

Out of memory is rehearsed (the driver's ``--inject_above``); each epoch must still
train every text of the slice exactly once: the texts and real tokens trained
over all processes equal the slice's.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tokenbatch.lengths import text_lengths

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_example_emotion import env, free_port

sys.path.pop(0)

REPO = Path(__file__).resolve().parents[1]
RUN = REPO / "tests" / "scripts" / "emotion_stream_run.py"
LIMIT = 240


@pytest.mark.slow
@pytest.mark.parametrize(("processes", "mode"), [(1, "split"), (2, "halve")])
def test_stream_example_trains_each_text_once_per_epoch(
    accelerate_launch: Any,
    processes: int,
    mode: str,
    tmp_path: Path,
    emotion_data_dir: Path,
    emotion_slice: Callable[[int, int], Path],
    minilm_path: str,
    minilm_tokenizer: Any,
) -> None:
    out = tmp_path / "epochs.json"
    args = [
        str(RUN),
        str(out),
        "--inject_above",
        "700",
        "--train_file",
        str(emotion_slice(LIMIT, 0) / "train.jsonl"),
        "--model_name",
        minilm_path,
        "--max_tokens",
        "1024",
        "--buffer_size",
        "64",
        "--oom_mode",
        mode,
        "--learning_rate",
        "1e-3",
    ]
    command = [sys.executable, *args]
    if processes > 1:
        command = [
            *accelerate_launch(processes, port=free_port()),
            *args,
        ]
    done = subprocess.run(command, env=env(tmp_path), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    epochs = json.loads(out.read_text())
    lines = (emotion_data_dir / "train.jsonl").read_text().splitlines()[:LIMIT]
    tokens = int(text_lengths([json.loads(line)["text"] for line in lines], minilm_tokenizer).sum())
    assert [e["epoch"] for e in epochs] == [1, 2]
    for epoch in epochs:
        assert epoch["texts"] == LIMIT and epoch["real_tokens"] == tokens
        assert epoch["steps"] >= 1 and epoch["loss"] > 0
    assert epochs[-1]["oom_events"] > 0 and epochs[-1]["max_tokens"] < 1024
    assert "Epoch: 2\tloss:" in done.stdout
