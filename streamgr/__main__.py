"""``python -m streamgr``: the same as the ``streamgr`` command."""

import sys

from .cli import main

sys.exit(main())
