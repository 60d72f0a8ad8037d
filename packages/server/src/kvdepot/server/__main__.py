"""`python -m kvdepot.server ...` runs the `kvdepot` command line with this interpreter."""

import sys

from kvdepot.server._cli import main

sys.exit(main(sys.argv[1:]))
