"""`python -m plait` is the same as the `plait` command."""

import sys

from plait.cli import main

sys.exit(main())
