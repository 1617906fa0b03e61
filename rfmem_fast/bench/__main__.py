"""``python -m rfmem_fast.bench [flags]``: the same as ``rfmem bench [flags]``."""
import sys

from .cli import main

sys.exit(main())
