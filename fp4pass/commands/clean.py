"""``fp4pass clean [DIR]``: remove the temporary files a killed fp4pass run left behind."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fp4pass.errors import UsageError
from fp4pass.io import TMP_PREFIX, remove_stale

EPILOG = f"""examples:
  fp4pass clean                      # the current folder
  fp4pass clean out/

Every file fp4pass writes is first written under a temporary name, {TMP_PREFIX}<pid>-..., in the target's
folder. A run killed with SIGKILL cannot remove its own; this removes those whose process no longer runs
(files and folders of a run still going are left alone). Any fp4pass run that writes into a folder does
the same first.
"""


def register(sub, common) -> None:
    p = sub.add_parser("clean", parents=[common], help="remove temporaries left by killed runs",
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder", nargs="?", default=".", metavar="DIR", help="the folder to clean (default: .)")
    p.set_defaults(run=run)


def run(args) -> int:
    folder = Path(args.folder)
    if not folder.is_dir():
        raise UsageError(f"{folder}: not a folder")
    removed = remove_stale(folder)
    for path in removed:
        print(path)
    print(f"fp4pass clean: removed {len(removed)} stale temporar{'y' if len(removed) == 1 else 'ies'} in {folder}",
          file=sys.stderr)
    return 0
