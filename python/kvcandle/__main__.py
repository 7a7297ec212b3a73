"""``python -m kvcandle``: the same as the ``kvcandle`` command (see kvcandle.cli)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
