"""`python -m kvgraft` runs the command line."""

import sys

from kvgraft.cli.main import main

sys.exit(main())
