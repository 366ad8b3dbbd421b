"""The kernel loader's builder lock: a build lock file left by a process killed mid-build no longer hangs the next
start (it is cleared once the builder lock is held), and a live builder's lock is waited for, not broken."""

from __future__ import annotations

import fcntl
import subprocess
import sys
import textwrap

from specserve.kernels.loader import BUILDER_LOCK, builder_lock

HOLD_AND_WAIT = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from specserve.kernels.loader import builder_lock
    d = Path(sys.argv[1])
    with builder_lock(d):
        (d / "lock").touch()  # torch's lock file, as a build in progress holds it
        print("holding", flush=True)
        time.sleep(600)
""")


def _held_by_someone(build_dir) -> bool:
    with open(build_dir / BUILDER_LOCK, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(f, fcntl.LOCK_UN)
        return False


def test_a_builder_killed_mid_build_leaves_nothing_that_blocks(tmp_path) -> None:
    holder = subprocess.Popen([sys.executable, "-c", HOLD_AND_WAIT, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "holding"
        assert _held_by_someone(tmp_path)  # a live builder: the next one would wait for it
        assert (tmp_path / "lock").exists()
    finally:
        holder.kill()  # SIGKILL mid-build: no cleanup runs, torch's lock file stays
        holder.wait()
    assert (tmp_path / "lock").exists() and not _held_by_someone(tmp_path)
    with builder_lock(tmp_path):  # taken at once, and the dead builder's lock file is gone
        assert not (tmp_path / "lock").exists()
    assert not _held_by_someone(tmp_path)
