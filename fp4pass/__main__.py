import sys

from fp4pass.cli import entry

sys.exit(entry())
