#!/usr/bin/env bash
# mypy --strict over the package as a wheel installs it: the repository's folders
# become tokenfleet.* only at packaging time, which mypy cannot follow through an
# editable install's import hook.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python -m pip install -q --no-deps --target "$tmp" "$root" 2>&1 | grep -v '^WARNING: Location' || true
cd "$tmp" && python -m mypy --config-file "$root/pyproject.toml" -p tokenfleet
