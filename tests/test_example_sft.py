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


@pytest.mark.parametrize("missing", ["model", "data"])
def test_offline_without_local_files_says_what_to_pass(
    emotion_slice: Callable[[int, int], Path], minilm_path: str, tmp_path: Path, missing: str
) -> None:
    """The defaults (dair-ai/emotion, Qwen/Qwen2.5-0.5B) without the hub: what to pass, no traceback."""
    import os
    import subprocess

    model_dir = tc.save_tiny(tmp_path / "tiny-llama", minilm_path, emotion_slice(8, 4), 8)
    args = ["--model_name", str(model_dir)] if missing == "data" else ["--data_dir", str(emotion_slice(8, 4))]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        "HF_HUB_OFFLINE": "1",
        "HF_HOME": str(tmp_path / "hf"),  # an empty cache: nothing of the hub's is on the machine
        "OMP_NUM_THREADS": "1",
    }
    # A bound against a hang only: the script stops before it trains.
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    if missing == "model":
        assert "Could not load --model_name Qwen/Qwen2.5-0.5B" in done.stderr
        assert "pass --model_name PATH to a local causal LM directory; examples/sft/README.md" in done.stderr
    else:
        assert (
            "Could not load the dair-ai/emotion dataset" in done.stderr
            and "pass --data_dir DIR" in done.stderr
        )


def test_a_tokenizer_without_an_eos_token_is_refused_with_the_fix(
    emotion_slice: Callable[[int, int], Path], minilm_path: str, tmp_path: Path
) -> None:
    """TRL's own error was TypeError: endswith first arg must be str ..., not NoneType."""
    from transformers import AutoTokenizer

    model_dir = tc.save_tiny(tmp_path / "tiny-llama", minilm_path, emotion_slice(8, 4), 8)
    AutoTokenizer.from_pretrained(minilm_path).save_pretrained(model_dir)  # BERT's: no eos token
    spec = importlib.util.spec_from_file_location("sft_train", SCRIPT)
    assert spec is not None and spec.loader is not None
    example: Any = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    with pytest.raises(SystemExit, match=r"has no eos_token, which SFTTrainer appends to every completion"):
        example.main(["--model_name", str(model_dir), "--data_dir", str(emotion_slice(8, 4))])
