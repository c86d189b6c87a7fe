"""``python -m distribute_utils``: the same as the ``distribute-utils`` command."""

import sys

from .cli import main

sys.exit(main())
