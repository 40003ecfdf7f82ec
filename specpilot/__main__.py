"""`python -m specpilot`: the same entry point as the `specpilot` command."""

import sys

from specpilot.cli import main

sys.exit(main())
