"""Entry point: ``python examples/multilingual/run.py <stage> [options]`` (``--help`` lists the stages)."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from multilingual.pipeline import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
