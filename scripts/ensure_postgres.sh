#!/usr/bin/env bash
# PostgreSQL's server binaries (initdb, postgres) for the store tests (tests/postgres_server.py,
# issue 24): nothing to do where they are installed; otherwise Debian's `postgresql` package,
# as root (or through passwordless sudo) where apt-get exists. Where it cannot be installed
# this warns and exits 0, and those tests skip with the reason; with ZEROHOP_REQUIRE_POSTGRES=1
# (set by .ci/run) it fails instead, and so do those tests, so CI cannot pass by skipping.
set -euo pipefail

found() {
	compgen -G '/usr/lib/postgresql/*/bin/initdb' >/dev/null || command -v initdb >/dev/null
}

give_up() {
	if [ "${ZEROHOP_REQUIRE_POSTGRES:-}" = 1 ]; then
		echo "ensure_postgres: $1 (ZEROHOP_REQUIRE_POSTGRES=1)" >&2
		exit 1
	fi
	echo "ensure_postgres: $1; the PostgreSQL tests will skip" >&2
	exit 0
}

found && exit 0
command -v apt-get >/dev/null || give_up "PostgreSQL is not installed and there is no apt-get"
if [ "$(id -u)" = 0 ]; then
	as_root=()
elif sudo -n true 2>/dev/null; then
	as_root=(sudo -n)
else
	give_up "PostgreSQL is not installed and apt-get needs root"
fi
echo "ensure_postgres: installing Debian's postgresql with apt-get ..." >&2
export DEBIAN_FRONTEND=noninteractive
"${as_root[@]}" apt-get update -q || give_up "apt-get update failed"
"${as_root[@]}" apt-get install -y -q --no-install-recommends postgresql ||
	give_up "apt-get install postgresql failed"
# The package starts its own cluster on port 5432 where an init system runs; the tests start
# their own servers, so stop it (harmless where none started).
"${as_root[@]}" service postgresql stop >/dev/null 2>&1 || true
found || give_up "postgresql installed but no initdb found"
