"""Writing outputs safely: checked before any work, never a partial file, never an input overwritten.

The rules every file fp4pass writes follows (``docs/bad-input.md`` states them for users):

1. **Checked first.** :func:`check_outputs` runs before a command does any work. For every output path it
   refuses: a path that is an input (the same path, through ``..`` or a symlink, or a hardlink: the same
   ``st_dev``/``st_ino``); two outputs that are the same file; a folder that does not exist or is not
   writable; a path that is an existing directory; an output inside an input folder (a calibration DIR).
2. **Only regular files are replaced** (:func:`output_target`). An output that is a symlink to a file in
   its own folder is written through (the file it names is replaced, the link stays); a symlink that leads
   out of the folder (``/dev/stdout``), and a device, FIFO, socket or folder, are refused: renaming over
   them would replace a file that is not ours.
3. **Atomic.** :func:`atomic_output` yields a temporary path in the target's own folder (same filesystem),
   named ``.fp4pass-tmp-<pid>-h<host>-<random>-<name>`` (:func:`temp_name`; the name is shortened so that
   the whole stays a legal file name); only a writer that finished is fsynced, then renamed onto the target,
   then the folder is fsynced. A crash, an error or a signal leaves the target as it was.
4. **Mode.** A finished output gets ``0o666 & ~umask``, like any file a program creates (the temporary file
   is private while it is written).
5. **Nothing left on failure, nothing of others removed.** Each rename is recorded in the current
   :class:`OutputSession` with the device and inode it put there; the CLI rolls the session back on a
   non-zero exit, removing what this run renamed in, and only while that path still holds this run's file
   (another run may have written it since). :meth:`OutputSession.rollback` says what exit 1 keeps.
6. **Stale temporaries.** Every temporary is a folder (``.fp4pass-tmp-<pid>-h<host>-<random>-<name>``,
   :func:`make_temp_folder`) holding a marker file, :data:`MARKER`: the pid, that process's start time
   (``/proc/PID/stat``), a token of the machine, boot and pid namespace it ran in (:func:`host_token`) and the
   folder's own device and inode. A killed run (SIGKILL) cannot clean up; the next :func:`atomic_output` or
   :func:`atomic_folder` in that folder, or ``fp4pass clean DIR``, removes the temporaries whose marker says
   they were made here by a process that is gone (the pid is not running, or runs with another start time)
   (:func:`remove_stale`). Only a real folder (not a symlink) whose marker checks out is ever removed: a file,
   a folder without the marker (a user's folder named like a temporary, an input), a copy of a temporary
   (another inode) or the input of the current run are never removed. A pid means nothing on another host
   or in another pid namespace sharing the folder: such temporaries go only with ``fp4pass clean
   --older-than HOURS``, and a run alive here is left alone even then.
7. **The rename is the last step.** :func:`atomic_folder` and :func:`finish` record the inode they rename in
   the :class:`OutputSession` before the rename, so a failure or a signal at any moment after it takes the
   output back out (the CLI rolls the session back); :func:`atomic_folder` also removes its folder itself
   when the rename's own aftermath (the folder's fsync) fails or is interrupted.
8. **Output folders are marked, and only what fp4pass wrote is replaced.** Every folder :func:`atomic_folder`
   writes holds :data:`OUTPUT_MARKER`, listing every file in it with its size. With ``overwrite`` an existing
   folder is replaced only when its marker is fp4pass's (a regular file, bounded in size and depth) and the
   folder holds nothing it does not list (:func:`fp4pass.io.folders.first_foreign_file`: the first other file is
   named), and no input of the run lies in it or holds it (:func:`fp4pass.io.folders.refuse_inputs`); checked
   before any work and again on the old folder right before the swap. The swap is
   :mod:`fp4pass.io.swap`'s two renames with their state on disk: a failure puts the old folder back, and
   a run killed in the middle is finished by the next sweep (:func:`remove_stale`, ``fp4pass clean``).

The modules: :mod:`fp4pass.io.outputs` (rules 1 to 5 and 7), :mod:`fp4pass.io.folders` and
:mod:`fp4pass.io.swap` (rule 8), :mod:`fp4pass.io.stale` (rule 6), :mod:`fp4pass.io.inputs` (the small files a
stranger hands in: regular files only, read exactly) and :mod:`fp4pass.io.jsonio` (strict JSON out, and the
one strict JSON reader for every file handed in). Every public name is importable from ``fp4pass.io``.
"""

from fp4pass.errors import UsageError  # noqa: F401  (raised by everything here; importable from here as before)
from fp4pass.io.folders import (OUTPUT_MARKER, atomic_folder, check_output_folder, written_by_fp4pass)
from fp4pass.io.inputs import (PSEUDO_FILESYSTEMS, file_kind, copy_regular_file, open_regular, pseudo_filesystem,
                               read_exact, read_regular_file, regular_file_status)
from fp4pass.io.jsonio import JSON_MAX_DEPTH, NON_FINITE_NOTE, finite_json, json_text, strict_json
from fp4pass.io.outputs import (REPORT, RESULT, OutputSession, atomic_output, check_outputs, finish, fsync_folder,
                                inside_folder, output_session, output_target, refuse_overwrite, same_file,
                                write_json)
from fp4pass.io.stale import (MARKER, TMP_PREFIX, host_token, make_temp_folder, process_start, remove_stale,
                              NAME_MAX_FALLBACK, temp_name, write_marker)

__all__ = [
    "TMP_PREFIX",
    "atomic_output",
    "check_outputs",
    "fsync_folder",
    "output_target",
    "read_regular_file",
    "regular_file_status",
    "OutputSession",
    "refuse_overwrite",
    "remove_stale",
    "same_file",
    "temp_name",
    "write_json",
    "json_text",
    "finite_json",
    "MARKER",
    "OUTPUT_MARKER",
    "check_output_folder",
    "written_by_fp4pass",
    "make_temp_folder",
    "copy_regular_file",
    "pseudo_filesystem",
    "inside_folder",
    "open_regular",
    "read_exact",
    "NAME_MAX_FALLBACK",
    "atomic_folder",
    "finish",
    "host_token",
    "output_session",
    "process_start",
    "write_marker",
    "NON_FINITE_NOTE",
    "PSEUDO_FILESYSTEMS",
    "REPORT",
    "RESULT",
    "JSON_MAX_DEPTH",
    "strict_json",
]
