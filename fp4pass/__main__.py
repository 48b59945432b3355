import sys

from fp4pass.cli import main

sys.exit(main())
