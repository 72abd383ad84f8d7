"""One writer per dataset directory: `data convert` and `data synth` hold OUT/.lock while they write.

Each run writes its parts under per-process temporary names and renames them at the end, so two
runs into one `--out` each leave whole files, but both report success while the dataset holds a
mix of the two (one run's parts, the other's _dataset.json). The second run is refused instead,
naming the first.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tpurec.data.leftovers import remove_tmp_files
from tpurec.data.schema import DataError, prepare_output_dir
from tpurec.runtime.dir_lock import lock_dir, unlock


@contextmanager
def locked_output(out_dir: str | os.PathLike, overwrite: bool, program: str) -> Iterator[Path]:
    """`prepare_output_dir(out_dir, overwrite)` under an exclusive lock held until the block ends
        (DataError naming the holder when another run writes there). Temporary files a killed run left
    there are removed first, in one line (tpurec/data/leftovers.py)."""
    held = lock_dir(
        out_dir,
        lambda holder: DataError(
            f"--out {out_dir} is being written by another run ({holder}); wait for it or give another --out"
        ),
        program,
    )
    try:
        # Held: any temporary file in there is a killed run's (SIGKILL gives no chance to clean up).
        remove_tmp_files(Path(out_dir), lambda line: print(f"tpurec data: {line}", file=sys.stderr))
        yield prepare_output_dir(out_dir, overwrite)
    finally:
        unlock(held)
