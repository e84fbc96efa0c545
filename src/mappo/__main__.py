"""``python -m mappo``: the ``mappo`` command."""

import sys

from mappo.cli import main

if __name__ == "__main__":
    sys.exit(main())
