"""`python -m fused_remat.training`: the same command line as `python -m fused_remat.train`."""

import sys

from .cli import main

sys.exit(main())
