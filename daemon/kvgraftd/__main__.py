"""`python -m kvgraftd` runs the daemon."""

import sys

from kvgraftd.main import main

sys.exit(main())
