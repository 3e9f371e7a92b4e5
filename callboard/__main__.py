"""``python -m callboard``: the same as the ``callboard`` command."""

import sys

from .cli import main

sys.exit(main())
