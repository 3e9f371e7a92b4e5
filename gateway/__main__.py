"""``python -m callboard.gateway``: ``callboard serve``."""

import sys

from callboard.gateway.server import main

sys.exit(main())
