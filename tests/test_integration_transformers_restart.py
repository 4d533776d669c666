"""TokenBudgetTrainer under torchrun survives a killed worker and a preemption: real processes, real signals.

tests/scripts/trainer_restart.py is the job: 2 CPU processes (gloo), halve mode, a real
out-of-memory error at the first step that halves the budget, a checkpoint every
``SAVE_STEPS`` optimizer steps, and each attempt resuming from
``last_checkpoint(output_dir)`` when there is one. Which samples each optimizer step
trained is read from the gradients (tests/scripts/trainer_common.py) and written by each rank
as the step happens, so a killed process leaves its record behind.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tokenbatch.testing import inject_oom

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "tests" / "scripts"
sys.path.insert(0, str(SCRIPTS))
try:
    import trainer_common as tc
finally:
    sys.path.pop(0)

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.slow]
SAVE_STEPS = 2


def job(data_dir: Path, out: Path, *, kill_step: int = -1, term_step: int = -1) -> int:
    """Run the job under ``torchrun --max-restarts 1``; its exit status (torchrun fails after a SIGTERM)."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        # torchrun shares one store across restarts, where the restarted gloo group can read the old
        # workers' addresses and fail ("Connection refused"): a store per attempt (docs/trainer.md).
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
    }
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    command += ["--max-restarts", "1", "--monitor-interval", "0.1", str(SCRIPTS / "trainer_restart.py")]
    command += [str(data_dir), str(out), str(SAVE_STEPS), str(kill_step), str(term_step)]
    child = subprocess.Popen(command, env=env, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _, stderr = child.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        pytest.fail(f"the job hung: {child.communicate()[1][-3000:]}")
    (out / "stderr.txt").write_text(stderr)
    return child.returncode


def steps(out: Path, rank: int, attempt: int) -> list[dict[str, Any]]:
    path = out / f"steps.rank{rank}.attempt{attempt}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def report(out: Path, rank: int, attempt: int) -> dict[str, Any] | None:
    path = out / f"report.rank{rank}.attempt{attempt}.json"
    return json.loads(path.read_text()) if path.exists() else None


def uses(*runs: list[dict[str, Any]]) -> dict[int, Counter[int]]:
    """For each epoch, how many optimizer steps each sample's gradient reached, over ``runs``."""
    counts: dict[int, Counter[int]] = {}
    for run in runs:
        for step in run:
            counts.setdefault(step["epoch"], Counter()).update(step["samples"])
    return counts


def test_a_worker_killed_while_saving_restarts_from_the_last_complete_checkpoint(
    emotion_data_dir: Path, tmp_path: Path
) -> None:
    """SIGKILL to rank 0 mid-checkpoint: torchrun restarts; the steps after the last checkpoint repeat."""
    import transformers

    if int(transformers.__version__.split(".")[0]) < 5:
        # Trainer 4.x loads the optimizer with map_location=args.device on several processes, which
        # is "cpu:0" under torchrun on CPU, and torch refuses it ("don't know how to restore data
        # location", seen on 4.50): the resume fails inside Trainer, with or without tokenbatch.
        pytest.skip("transformers 4.x cannot resume its optimizer under torchrun on CPU")
    seed = random.randrange(10**6)
    kill = SAVE_STEPS * random.Random(seed).randint(2, 4)  # saving checkpoint-<kill> when killed
    context = f"seed {seed}: killed while saving checkpoint-{kill}"
    status = job(emotion_data_dir, tmp_path, kill_step=kill)
    assert status == 0, (context, (tmp_path / "stderr.txt").read_text()[-3000:])

    first, second = steps(tmp_path, 0, 0), steps(tmp_path, 0, 1)
    assert [step["global_step"] for step in first] == list(range(kill)), context
    assert report(tmp_path, 0, 0) is None and report(tmp_path, 1, 0) is None  # neither ended train()
    again = kill - SAVE_STEPS  # the last complete checkpoint: the steps after it are trained again
    for rank in (0, 1):
        done = report(tmp_path, rank, 1)
        assert done is not None, context
        assert steps(tmp_path, rank, 1) == second, context  # the ranks trained the same steps
        # transformers' choice is the half-written folder; the newest complete one is resumed.
        assert (done["get_last_checkpoint"], done["resumed_from"]) == (
            f"checkpoint-{kill}",
            f"checkpoint-{again}",
        )
        assert done["global_step"] == done["max_steps"] == second[-1]["global_step"] + 1, context
        # The budget the out-of-memory error lowered in attempt 0 is kept: nothing above it ran again.
        (event,) = done["events"]
        assert (event["epoch"], event["step"], event["attempt"]) == (0, 0, 0)
        assert done["injected"] == 0 and done["max_tokens"] == event["new_max_tokens"] < tc.MAX_TOKENS
    assert [step["global_step"] for step in second] == list(range(again, second[-1]["global_step"] + 1))
    repeated = [step for step in first if step["global_step"] >= again]
    assert second[: len(repeated)] == repeated, context  # the same steps, the same samples
    twice = Counter(sample for step in repeated for sample in step["samples"])
    assert len(repeated) == SAVE_STEPS and len(twice) > 0
    counts = uses(first, second)
    assert sorted(counts) == [0, 1], context
    for epoch, count in counts.items():
        assert sorted(count) == list(range(tc.TRAIN_SIZE)), (context, epoch)
        expected = {sample: 1 + (twice[sample] if repeated[0]["epoch"] == epoch else 0) for sample in count}
        assert dict(count) == expected, (context, epoch)


def test_a_preempted_job_checkpoints_at_the_next_step_and_resumes_on_fewer_processes(
    emotion_data_dir: Path, minilm_tokenizer: Any, tmp_path: Path
) -> None:
    """SIGTERM to torchrun: both ranks save at the end of the step in progress and end train(); 2 -> 1."""
    from transformers import TrainingArguments

    from tokenbatch.integrations.transformers import last_checkpoint

    if "enable_jit_checkpoint" not in TrainingArguments.__dataclass_fields__:
        pytest.skip("transformers 4.x has no enable_jit_checkpoint: a SIGTERM ends the process there")
    seed = random.randrange(10**6)
    term = random.Random(seed).randint(3, 8)
    context = f"seed {seed}: SIGTERM during optimizer step {term}"
    status = job(emotion_data_dir, tmp_path, term_step=term)
    stderr = (tmp_path / "stderr.txt").read_text()
    assert status != 0 and "Received 15 death signal" in stderr, (context, stderr[-3000:])  # no restart

    before = steps(tmp_path, 0, 0)
    assert [step["global_step"] for step in before] == list(range(term + 1)), context
    for rank in (0, 1):
        done = report(tmp_path, rank, 0)
        assert done is not None, (context, stderr[-3000:])  # train() returned: a clean exit
        assert done["received"] and done["global_step"] == term + 1 < done["max_steps"], context
        assert steps(tmp_path, rank, 0) == before
    assert report(tmp_path, 0, 1) is None and not steps(tmp_path, 0, 1)
    checkpoint = last_checkpoint(tmp_path / "run")
    assert checkpoint is not None and Path(checkpoint).name == f"checkpoint-{term + 1}", context

    resumed = tc.make_trainer(emotion_data_dir, minilm_tokenizer, tmp_path / "resumed", oom_mode="halve")
    injector = inject_oom(resumed.model, tc.OOM_LIMIT, where="forward")
    resumed.train(resume_from_checkpoint=checkpoint)  # on 1 process
    after = resumed.recorder.steps
    assert injector.count == 0 and len(resumed.oom_events) == 1  # the halved budget came with it
    assert after[0]["global_step"] == term + 1 and resumed.state.global_step == resumed.state.max_steps
    counts = uses(before, after)
    assert sorted(counts) == [0, 1], context
    for epoch, count in counts.items():  # every sample once per epoch: nothing lost, nothing repeated
        assert sorted(count) == list(range(tc.TRAIN_SIZE)) and set(count.values()) == {1}, (context, epoch)
