"""``python -m rxcoord``: the same as the ``rxcoord`` console script."""

import sys

from ._cli.main import main

if __name__ == "__main__":
    sys.exit(main())
