"""``python -m callboard.bench``: run the load bench (see ``callboard.bench.harness``)."""

import sys

from .harness import main

sys.exit(main())
