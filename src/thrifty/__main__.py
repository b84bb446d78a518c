"""``python -m thrifty ...`` runs the ``thrifty`` command."""

import sys

from .cli import main

if __name__ == "__main__":  # importing the module (e.g. a package scan) must not run the CLI
    sys.exit(main())
