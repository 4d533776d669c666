"""examples/emotion/stream.py with a tiny random BERT (see emotion_run.py); its epochs to OUT.json.

Usage: ``emotion_stream_run.py OUT.json [stream.py's options]``, one process or under ``accelerate launch``.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its sibling modules, however it is run

from emotion_run import EXAMPLE, tiny_encoder


def main(out: Path, argv: list[str]) -> None:
    sys.path.insert(0, str(EXAMPLE))
    spec = importlib.util.spec_from_file_location("emotion_stream", EXAMPLE / "stream.py")
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    example.load_encoder = tiny_encoder
    epochs = example.main(argv)
    out.write_text(json.dumps(epochs, indent=2) + "\n")  # the same on every process (reduced)


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
