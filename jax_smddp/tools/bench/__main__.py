"""``python -m jax_smddp.tools.bench``."""

import sys

from jax_smddp.tools.bench.cli import main

if __name__ == "__main__":
  sys.exit(main())
