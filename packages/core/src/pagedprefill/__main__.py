"""``python -m pagedprefill``: the same as the ``pagedprefill`` command."""

import sys

from .cli import main

sys.exit(main())
