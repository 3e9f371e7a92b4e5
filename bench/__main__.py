"""``python -m callboard.bench``: run the load bench (see ``callboard.bench.harness``)."""

import sys

from callboard.bench.harness import main

sys.exit(main())
