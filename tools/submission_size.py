"""How big this session's submission is, against the limits a submission must stay under.

A stop submits every commit since the checkout it started from. It is rejected whole when those commits,
packed as git sends them, pass 512 MiB, or when their diffs, added up as text, pass 256 MiB (a file added in
one commit and removed in a later one counts twice; a binary file's diff is counted here as if it were text:
its old and its new bytes). One earlier try lost all of its work to that limit by committing trained heads
more than once, so run this before stopping, and commit a large file (a head's safetensors) once, at the end:

    python tools/submission_size.py              # since the commit the checkout started from (HEAD's reflog)
    python tools/submission_size.py --base REV   # since REV

Exit status 1 when the estimate is over either limit (or over ``--margin`` of it), 0 otherwise.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

MIB = 1 << 20
PACK_LIMIT = 512 * MIB
DIFF_LIMIT = 256 * MIB


def git(*args: str, stdin: bytes | None = None) -> bytes:
    return subprocess.run(["git", *args], input=stdin, capture_output=True, check=True).stdout


def start_commit() -> str:
    """The oldest entry of HEAD's reflog: the commit this checkout was created at."""
    lines = git("reflog", "show", "--format=%H", "HEAD").decode().split()
    if not lines:
        raise SystemExit("HEAD has no reflog; pass --base")
    return lines[-1]


def packed_bytes(base: str) -> int:
    """Bytes of the pack git would send for ``base..HEAD``."""
    revs = f"HEAD\n^{base}\n".encode()
    return len(git("pack-objects", "--revs", "--stdout", "--delta-base-offset", "-q", stdin=revs))


def diff_bytes(commit: str) -> tuple[int, list[tuple[int, str]]]:
    """One commit's diff size as text, binary files counted as their old plus new bytes; and the files it touches
    with their share, largest first."""
    parents = git("rev-list", "--parents", "-n", "1", commit).decode().split()[1:]
    parent = parents[0] if parents else git("hash-object", "-t", "tree", "/dev/null").decode().strip()
    total, files = 0, []
    rows = git("diff", "--raw", "-z", "--no-renames", "--no-abbrev", parent, commit).split(b"\0")
    # --raw -z: ":old_mode new_mode old_sha new_sha status\0path\0" per file
    for meta, path in zip(rows[0::2], rows[1::2]):
        if not meta.startswith(b":"):
            continue
        _, _, old_sha, new_sha, _ = meta[1:].decode().split(" ")
        size = sum(int(git("cat-file", "-s", sha).decode()) for sha in (old_sha, new_sha) if set(sha) != {"0"})
        total += size
        files.append((size, path.decode(errors="replace")))
    return total, sorted(files, reverse=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", help="the commit the submission starts after (default: this checkout's first)")
    ap.add_argument("--margin", type=float, default=0.8, help="fail above this fraction of a limit")
    ap.add_argument("--top", type=int, default=8, help="list this many of the largest file changes")
    args = ap.parse_args()
    base = args.base or start_commit()
    commits = git("rev-list", "--reverse", f"{base}..HEAD").decode().split()
    packed = packed_bytes(base) if commits else 0
    diffs, largest = 0, []
    for c in commits:
        size, files = diff_bytes(c)
        diffs += size
        largest += [(s, f"{c[:10]} {p}") for s, p in files]
    print(f"{len(commits)} commits since {base[:10]}")
    print(f"packed: {packed / MIB:8.1f} MiB of {PACK_LIMIT // MIB} MiB")
    print(f"diffs:  {diffs / MIB:8.1f} MiB of {DIFF_LIMIT // MIB} MiB (binary files as old + new bytes)")
    for size, name in sorted(largest, reverse=True)[:args.top]:
        print(f"  {size / MIB:8.1f} MiB  {name}")
    over = packed > args.margin * PACK_LIMIT or diffs > args.margin * DIFF_LIMIT
    if over:
        print(f"over {args.margin:.0%} of a limit: squash or drop commits before stopping", file=sys.stderr)
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main())
