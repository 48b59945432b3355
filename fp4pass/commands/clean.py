"""``fp4pass clean [DIR]``: remove the temporary files a killed fp4pass run left behind."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from fp4pass.errors import UsageError
from fp4pass.io import MARKER, TMP_PREFIX, remove_stale

EPILOG = f"""examples:
  fp4pass clean                      # the current folder
  fp4pass clean out/
  fp4pass clean /mnt/nfs/out --older-than 24   # also other hosts' temporaries, untouched for a day

Every file fp4pass writes is first written inside a temporary folder, {TMP_PREFIX}<pid>-h<host>-..., in the
target's folder, holding a marker file ({MARKER}) with the pid, that process's start time, a token of the
host and the folder's inode. A run killed with SIGKILL cannot remove its own; this removes those whose marker
says they were made on this host (and pid namespace) by a process that no longer runs. A run still going
(its pid alive with the same start time) is left alone, with --older-than too. Nothing without a valid marker
is ever removed: a file or a folder merely named like a temporary stays. Any fp4pass run that writes into a
folder does the same first. An output folder that a killed `convert --overwrite` had moved aside into its
temporary is put back first when nothing stands in its place (a temporary whose folder cannot go back stays).
A pid says nothing about a run on another host or in another container sharing
the folder: those temporaries go only with --older-than.
"""


def register(sub, common) -> None:
    p = sub.add_parser("clean", parents=[common], help="remove temporaries left by killed runs",
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder", nargs="?", default=".", metavar="DIR", help="the folder to clean (default: .)")
    p.add_argument("--older-than", type=_hours, default=None, metavar="HOURS",
                   help="also remove fp4pass temporaries of another host or container not modified for this "
                        "many hours (a run alive here is always left alone)")
    p.set_defaults(run=run)


def _hours(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of hours") from None
    if not 0 <= value < 1e6:
        raise argparse.ArgumentTypeError(f"{text!r} must be a number of hours in [0, 1e6)")
    return value


def run(args) -> int:
    folder = Path(args.folder)
    if not folder.is_dir():
        raise UsageError(f"{folder}: not a folder")
    restored: list[Path] = []
    removed = remove_stale(folder, None if args.older_than is None else args.older_than * 3600, restored=restored)
    for path in restored:
        print(f"fp4pass clean: put back {path}, the output folder a killed --overwrite had moved aside",
              file=sys.stderr)
    for path in removed:
        print(path)
    print(f"fp4pass clean: removed {len(removed)} stale temporar{'y' if len(removed) == 1 else 'ies'} in {folder}",
          file=sys.stderr)
    return 0
