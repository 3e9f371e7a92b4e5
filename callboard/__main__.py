"""``python -m callboard``: the same as the ``callboard`` command."""

import sys

from callboard._entry import main

sys.exit(main())
