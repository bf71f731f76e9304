#!/usr/bin/env bash
# Write the unified diff of upstream files between a pristine and an edited sglang tree, with
# the a/sglang/... b/sglang/... paths that patches/ uses. The header is taken from HEADER_FILE.
#   scripts/mkpatch.sh PRISTINE_SITE EDITED_SITE HEADER_FILE sglang/path1.py [sglang/path2.py ...] > patches/NNNN-name.patch
set -euo pipefail
pristine=$1 edited=$2 header=$3; shift 3
cat "$header"
echo
for f in "$@"; do
  diff -u --label "a/$f" --label "b/$f" "$pristine/$f" "$edited/$f" || [ $? -eq 1 ]
done
