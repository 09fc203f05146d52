"""`python -m heterorl ...` is the same as the `heterorl` command."""

import sys

from heterorl.cli import main

sys.exit(main())
