"""``python -m readie``: the ``readie`` command."""

import sys

from .cli import main

sys.exit(main())
