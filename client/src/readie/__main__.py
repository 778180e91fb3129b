"""``python -m readie``: the ``readie`` command."""

import sys

from ._cli import main

sys.exit(main())
