"""`python -m specpilot.tui`: the terminal app without the main CLI's start-up."""

import sys

from specpilot.tui.launch import main

sys.exit(main())
