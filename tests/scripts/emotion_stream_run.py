"""examples/emotion/stream.py with a tiny random BERT and rehearsed OOMs (see emotion_run.py); epochs to JSON.

Usage: ``emotion_stream_run.py OUT.json [--inject_above COST ...] [stream.py's options]``, one process or
under ``accelerate launch``.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its sibling modules, however it is run

from emotion_run import load_example, rehearsal, rehearse


def main(out: Path, argv: list[str]) -> None:
    options, argv = rehearsal(argv)
    example = load_example("stream.py")
    rehearse(example, options)
    epochs = example.main(argv)
    out.write_text(json.dumps(epochs, indent=2) + "\n")  # the same on every process (reduced)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
