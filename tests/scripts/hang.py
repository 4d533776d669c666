"""A 'distributed' script that hangs: each process writes its pid to ``argv[1]``, says so, and sleeps."""

import os
import sys
import time
from pathlib import Path

if __name__ == "__main__":
    Path(sys.argv[1], f"pid{os.environ['RANK']}").write_text(str(os.getpid()))
    print("about to hang", file=sys.stderr, flush=True)
    time.sleep(600)
