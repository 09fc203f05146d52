"""`python -m pipeline ...` is the same as the `heterorl` command."""

import sys

from pipeline.cli import main

sys.exit(main())
