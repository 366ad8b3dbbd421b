"""The kernel loader clears a build lock left by a killed process, and leaves a live one alone."""

from __future__ import annotations

import os
import time

from specserve.kernels.loader import clear_stale_lock


def test_stale_lock_is_removed_and_fresh_lock_kept(tmp_path) -> None:
    assert not clear_stale_lock(tmp_path)  # no lock at all
    lock = tmp_path / "lock"
    lock.touch()
    assert not clear_stale_lock(tmp_path, max_age_s=600) and lock.exists()
    old = time.time() - 3600
    os.utime(lock, (old, old))
    assert clear_stale_lock(tmp_path, max_age_s=600) and not lock.exists()
