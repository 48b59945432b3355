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
  fp4pass clean /mnt/nfs/out --older-than 24   # also other hosts' temporaries, untouched for a day

Every file fp4pass writes is first written under a temporary name, {TMP_PREFIX}<pid>-h<host>-..., in the
target's folder. A run killed with SIGKILL cannot remove its own; this removes those made on this host (and
pid namespace) whose process no longer runs (files and folders of a run still going are left alone). Any
fp4pass run that writes into a folder does the same first. A pid says nothing about a run on another host
or in another container sharing the folder: those temporaries go only with --older-than.
"""


def register(sub, common) -> None:
    p = sub.add_parser("clean", parents=[common], help="remove temporaries left by killed runs",
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("folder", nargs="?", default=".", metavar="DIR", help="the folder to clean (default: .)")
    p.add_argument("--older-than", type=_hours, default=None, metavar="HOURS",
                   help="also remove any fp4pass temporary (another host's, another container's) not modified "
                        "for this many hours")
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
    removed = remove_stale(folder, None if args.older_than is None else args.older_than * 3600)
    for path in removed:
        print(path)
    print(f"fp4pass clean: removed {len(removed)} stale temporar{'y' if len(removed) == 1 else 'ies'} in {folder}",
          file=sys.stderr)
    return 0
