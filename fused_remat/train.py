"""`python -m fused_remat.train` (and `torchrun -m fused_remat.train`): the training CLI's entry
point, kept so the command stays as it was. The application is the package
``fused_remat.training`` (its docstring lists the modules); this module only runs
``fused_remat.training.cli.main``. Nothing imports it: the library never imports the training
package."""

import sys

from fused_remat.training.cli import main

if __name__ == "__main__":
    sys.exit(main())
