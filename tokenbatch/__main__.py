"""``python -m tokenbatch`` runs the command line."""

import sys

from tokenbatch.cli import main

sys.exit(main())
