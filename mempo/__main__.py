"""`python -m mempo` is the `mempo` command."""

import sys

from mempo.cli import main

sys.exit(main())
