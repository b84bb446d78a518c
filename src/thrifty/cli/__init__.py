"""``thrifty <verb>``: the one command line of the package (``python -m thrifty`` runs the same).

Verbs: ``setup``, ``demo``, ``optimize``, ``pretrain``, ``eval``, ``compress``, ``decompress``, ``stage``; each
has ``--help``. A user error (a bad argument, a missing file) prints one line, ``thrifty <verb>: <what>``, and
exits with status 2. No technique package imports this one: it sits above all of them.
"""

from .main import main

__all__ = ["main"]
