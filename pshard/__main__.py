"""``python -m pshard``: the same as the ``pshard`` command."""

import sys

from pshard.cli import main

if __name__ == "__main__":
    sys.exit(main())
