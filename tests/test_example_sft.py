"""examples/sft/train.py end to end, offline: a tiny Llama saved to a directory, an emotion slice, 1 epoch."""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("trl")

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "examples" / "sft" / "train.py"
sys.path.insert(0, str(REPO / "tests" / "scripts"))

import trl_common as tc  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "padding_free"])
def test_the_example_fine_tunes_a_local_model(
    packed: bool,
    emotion_slice: Callable[[int, int], Path],
    minilm_path: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    data_dir = emotion_slice(48, 16)
    model_dir = tc.save_tiny(tmp_path / "tiny-llama", minilm_path, data_dir, 48)
    spec = importlib.util.spec_from_file_location("sft_train", SCRIPT)
    assert spec is not None and spec.loader is not None
    example: Any = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    monkeypatch.chdir(tmp_path)
    argv = ["--model_name", str(model_dir), "--data_dir", str(data_dir), "--output_dir", "out"]
    argv += ["--max_length", "64", "--max_tokens", "400", "--learning_rate", "1e-3"]
    example.main([*argv, *(["--padding_free"] if packed else [])])
    (line,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith('{"train_loss"')]
    metrics = json.loads(line)
    assert math.isfinite(metrics["train_loss"]) and math.isfinite(metrics["eval_loss"])
    (checkpoint,) = (tmp_path / "out").glob("checkpoint-*")
    assert (checkpoint / "tokenbatch_state.json").is_file()  # resumable mid-epoch
