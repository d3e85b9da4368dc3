"""``python -m jax_fp4``: the ``jax-fp4`` command (:mod:`jax_fp4.cli`)."""
import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
