"""``python -m specdec``: the same command line as the ``specdec`` console script."""

import sys

from specdec.cli import main

if __name__ == "__main__":
    sys.exit(main())
