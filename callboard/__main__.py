"""``python -m callboard``: the same as the ``callboard`` command."""

import sys

from callboard.cli import main

sys.exit(main())
