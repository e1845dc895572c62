#!/usr/bin/env bash
# Tag a release vX.Y.Z (CHANGELOG.md, "Releases and tags"). Checks, then tags; pushes nothing.
#   tools/tag_release.sh          # tag HEAD as v<__version__>
#   tools/tag_release.sh --check  # only the checks (what tests/cli/test_packaging.py runs)
# The version is read from umbp_nvme/__init__.py, the one place it is written. Refused, with the
# reason: a version that is not X.Y.Z, no "## [X.Y.Z] - YYYY-MM-DD" heading in CHANGELOG.md, a
# dirty tree, or a tag vX.Y.Z that already exists on another commit.
set -euo pipefail
cd "$(dirname "$0")/.."
check_only=0
[[ "${1:-}" == --check ]] && check_only=1
ver=$(sed -n 's/^__version__ = "\(.*\)"$/\1/p' umbp_nvme/__init__.py)
fail() { echo "tag_release: $*" >&2; exit 1; }
[[ "$ver" =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]] \
  || fail "umbp_nvme/__init__.py's __version__ is '${ver}', not X.Y.Z (three numbers)"
grep -Eq "^## \[${ver//./\\.}\] - [0-9]{4}-[0-9]{2}-[0-9]{2}$" CHANGELOG.md \
  || fail "CHANGELOG.md has no '## [$ver] - YYYY-MM-DD' heading: move Unreleased's entries under it"
((check_only)) && { echo "tag_release: v$ver is ready to tag"; exit 0; }
[[ -z "$(git status --porcelain)" ]] || fail "the work tree has changes: commit them first"
if git rev-parse -q --verify "refs/tags/v$ver" >/dev/null; then
  [[ "$(git rev-list -n1 "v$ver")" == "$(git rev-parse HEAD)" ]] \
    || fail "v$ver already tags $(git rev-list -n1 "v$ver" | cut -c1-12); raise __version__ for a new release"
  echo "tag_release: v$ver already tags HEAD"; exit 0
fi
git tag -a "v$ver" -m "umbp_nvme $ver"
echo "tag_release: tagged $(git rev-parse --short HEAD) as v$ver (push: git push origin v$ver)"
