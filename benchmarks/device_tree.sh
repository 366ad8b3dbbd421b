#!/usr/bin/env bash
# The shipped head (heads/, 64 MB) makes the tracked tree larger than a GPU-machine call may carry (64 MiB).
# Before device calls, `hide` takes heads/ out of the index and ignores it locally (the files stay on disk; a
# call that needs the head names `heads` in its carry); `restore` puts it back. Never commit while hidden:
# the commit would delete the head (stop 29 did, and amended it), so `hide` also installs a pre-commit hook that
# refuses to commit until `restore`. `status` says which state the checkout is in.
set -euo pipefail
cd "$(dirname "$0")/.."
exclude=.git/info/exclude
hook=.git/hooks/pre-commit
case "${1:-status}" in
  hide)
    git rm -r --cached -q heads
    grep -qx '/heads/' "$exclude" 2>/dev/null || echo '/heads/' >> "$exclude"
    mkdir -p "$(dirname "$hook")"
    if [ ! -e "$hook" ]; then
      printf '#!/bin/sh\n# installed by benchmarks/device_tree.sh hide\necho "heads/ is hidden (benchmarks/device_tree.sh restore first): this commit would delete it" >&2\nexit 1\n' > "$hook"
      chmod +x "$hook"
    fi
    echo "heads/ hidden: tracked tree $(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1) bytes" ;;
  restore)
    git reset -q -- heads
    sed -i '/^\/heads\/$/d' "$exclude"
    if grep -q 'installed by benchmarks/device_tree.sh hide' "$hook" 2>/dev/null; then rm -f "$hook"; fi
    echo "heads/ restored" ;;
  status)
    if grep -qx '/heads/' "$exclude" 2>/dev/null; then echo hidden; else echo tracked; fi ;;
  *) echo "usage: $0 hide|restore|status" >&2; exit 2 ;;
esac
