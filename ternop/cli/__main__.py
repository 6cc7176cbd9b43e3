"""``python -m ternop.cli``: the ``ternop`` console script."""

import sys

from ternop.cli import main

sys.exit(main())
