"""One spawned DDP script run shared by the tests that read it: each script starts its 2 CPU ranks (gloo) once.

Starting a rank pair (two interpreters importing torch and Lightning, a gloo group) is most of a DDP test's cost, so
a script runs every case it has in one pair and the tests read what it wrote.
"""

from __future__ import annotations

import atexit
import functools
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path


@functools.cache
def run_script(script: Path, *args: str, timeout: float = 300) -> tuple[Path, str]:
    """Run `python SCRIPT OUT_DIR ARGS...` once per session; returns OUT_DIR and the run's stdout + stderr.

    A failed run raises `AssertionError` with the output's tail, and is not cached: every test that reads it fails.
    """
    out = Path(tempfile.mkdtemp(prefix="gpumem-ddp-"))
    atexit.register(shutil.rmtree, out, ignore_errors=True)
    proc = subprocess.run(
        [sys.executable, str(script), str(out), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    errors = [line for line in proc.stderr.splitlines() if "Error" in line or "Exception" in line]
    assert proc.returncode == 0, "\n".join([*errors[-1:], proc.stdout[-3000:], proc.stderr[-3000:]])
    return out, proc.stdout + proc.stderr
