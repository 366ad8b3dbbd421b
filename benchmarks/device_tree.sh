#!/usr/bin/env bash
# The shipped head (heads/, 64 MB) makes the tracked tree larger than a GPU-machine call may carry (64 MiB).
# Before device calls, `hide` takes heads/ out of the index and ignores it locally (the files stay on disk; a
# call that needs the head names `heads` in its carry); `restore` puts it back. Never commit while hidden:
# the commit would delete the head. `status` says which state the checkout is in.
set -euo pipefail
cd "$(dirname "$0")/.."
exclude=.git/info/exclude
case "${1:-status}" in
  hide)
    git rm -r --cached -q heads
    grep -qx '/heads/' "$exclude" 2>/dev/null || echo '/heads/' >> "$exclude"
    echo "heads/ hidden: tracked tree $(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1) bytes" ;;
  restore)
    git reset -q -- heads
    sed -i '/^\/heads\/$/d' "$exclude"
    echo "heads/ restored" ;;
  status)
    if grep -qx '/heads/' "$exclude" 2>/dev/null; then echo hidden; else echo tracked; fi ;;
  *) echo "usage: $0 hide|restore|status" >&2; exit 2 ;;
esac
