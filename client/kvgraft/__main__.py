"""`python -m kvgraft` runs the command line."""

import sys

from kvgraft.cli import main

sys.exit(main())
