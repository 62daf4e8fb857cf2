#!/usr/bin/env bash
# The binaries two test modules need and pip cannot give: Debian's headless Chromium and its driver (the lock
# page's tests, tests/test_page.py; never a downloaded browser) and promtool (the shipped alert rules,
# tests/test_dashboard.py; Debian's prometheus package, of which only the binary is used: no service is started).
#
# Used by `make test` and by .ci/run, so both install the same packages the same way. When one is missing and
# this runs as root with apt-get, it installs them quietly (apt's output is shown only if it fails). When it
# cannot, it says at once which tests will be reported as skipped, and why, instead of letting that surface in
# the summary at the end. Exit status 0 unless --strict (CI) and something is still missing.
set -uo pipefail

strict=0
[ "${1:-}" = "--strict" ] && strict=1

need=()      # Debian packages to install
tests=()     # what skips without them
if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then
  need+=(chromium chromium-driver)
  tests+=("the lock page's browser tests (tests/test_page.py: chromium, chromedriver)")
fi
if ! command -v promtool >/dev/null 2>&1; then
  need+=(prometheus)
  tests+=("the alert-rule tests (tests/test_dashboard.py: promtool)")
fi
[ ${#need[@]} -eq 0 ] && exit 0

why=""
if [ "$(id -u)" != 0 ]; then
  why="not root, so apt-get cannot install them: run 'sudo apt-get install ${need[*]}'"
elif ! command -v apt-get >/dev/null 2>&1; then
  why="no apt-get on this machine: install ${need[*]} (Debian names) with its package manager"
else
  echo "provision: installing ${need[*]} with apt-get (Debian packages; output shown only on failure)..."
  log="$(mktemp -t lockguard-provision.XXXXXX)"
  if { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${need[@]}"; } \
      >"$log" 2>&1; then
    rm -f "$log"
    exit 0
  fi
  cat "$log" >&2
  why="apt-get install ${need[*]} failed (its output is above, and in $log)"
fi

{
  echo "provision: these tests will be reported as skipped (missing on this machine):"
  for t in "${tests[@]}"; do echo "  - $t"; done
  echo "  why: $why"
} >&2
[ $strict -eq 1 ] && exit 1
exit 0
