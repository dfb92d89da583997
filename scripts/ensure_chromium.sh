#!/usr/bin/env bash
# Chromium for the console's browser tests (tests/browser.py drives it with Playwright; no
# browser is downloaded): nothing to do where /usr/bin/chromium exists; otherwise Debian's
# `chromium` package, as root (or through passwordless sudo) where apt-get exists, with an
# `apt-get update` first when the install fails on stale package lists. Where it cannot be
# installed this warns and exits 0, and those tests skip with the reason; with
# ZEROHOP_REQUIRE_BROWSER=1 (set by .ci/run) it fails instead, and so do those tests.
set -euo pipefail

CHROMIUM=/usr/bin/chromium

give_up() {
	if [ "${ZEROHOP_REQUIRE_BROWSER:-}" = 1 ]; then
		echo "ensure_chromium: $1 (ZEROHOP_REQUIRE_BROWSER=1)" >&2
		exit 1
	fi
	echo "ensure_chromium: $1; the browser tests will skip" >&2
	exit 0
}

[ -x "$CHROMIUM" ] && exit 0
command -v apt-get >/dev/null || give_up "chromium is not installed and there is no apt-get"
if [ "$(id -u)" = 0 ]; then
	as_root=()
elif sudo -n true 2>/dev/null; then
	as_root=(sudo -n)
else
	give_up "chromium is not installed and apt-get needs root"
fi
echo "ensure_chromium: installing Debian's chromium with apt-get ..." >&2
export DEBIAN_FRONTEND=noninteractive
# fonts-liberation: metric-compatible fonts for the pages and their screenshots.
install() { "${as_root[@]}" apt-get install -y -q --no-install-recommends chromium fonts-liberation; }
if ! install; then
	"${as_root[@]}" apt-get update -q || give_up "apt-get update failed"
	install || give_up "apt-get install chromium failed"
fi
[ -x "$CHROMIUM" ] || give_up "chromium installed but $CHROMIUM is missing"
