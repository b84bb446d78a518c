"""``python -m thrifty ...`` runs the ``thrifty`` command."""

import sys

from .cli import main

sys.exit(main())
