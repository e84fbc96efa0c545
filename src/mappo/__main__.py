"""``python -m mappo``: the ``mappo`` command."""

import sys

from mappo.cli import main

sys.exit(main())
