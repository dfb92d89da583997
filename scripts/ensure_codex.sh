#!/usr/bin/env bash
# The real OpenAI Codex CLI for the Responses API tests (tests/codex.py): npm's @openai/codex
# at a pinned version, installed into the project-local .cache/codex (never globally, never
# into the user's home). Nothing to do where that version is installed there and runs. The
# package is a Node launcher (bin/codex.js) for a native binary that comes in an optional
# platform package (@openai/codex-linux-x64 and the like, an npm alias of
# @openai/codex@VERSION-linux-x64); an install that skips optional dependencies leaves a
# launcher that cannot start, so success here is `codex --version` printing the version.
# Where npm is missing or the install fails this warns and exits 0, and the tests skip with
# the reason; with ZEROHOP_REQUIRE_CODEX=1 (set by .ci/run) it fails instead, and so do the
# tests, so CI cannot pass by skipping.
set -euo pipefail

VERSION="${CODEX_VERSION:-0.171.0}"
PACKAGE=@openai/codex
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PREFIX="$ROOT/.cache/codex"
CODEX="$PREFIX/node_modules/.bin/codex"

give_up() {
	if [ "${ZEROHOP_REQUIRE_CODEX:-}" = 1 ]; then
		echo "ensure_codex: $1 (ZEROHOP_REQUIRE_CODEX=1)" >&2
		exit 1
	fi
	echo "ensure_codex: $1; the Codex tests will skip" >&2
	exit 0
}

installed_version() {
	# `codex --version` prints "codex-cli 0.171.0".
	"$CODEX" --version 2>/dev/null | awk '{print $NF}'
}

[ -x "$CODEX" ] && [ "$(installed_version)" = "$VERSION" ] && exit 0
command -v npm >/dev/null || give_up "npm is not installed (Codex comes from npm)"
command -v node >/dev/null || give_up "node is not installed (Codex's launcher is a Node script)"
echo "ensure_codex: installing $PACKAGE@$VERSION into $PREFIX with npm ..." >&2
# Into a staging folder first, so an interrupted install never looks installed. --include=optional
# so that an npm configured to omit optional dependencies still fetches the native binary.
staging="$PREFIX.staging"
rm -rf "$staging"
mkdir -p "$staging"
if ! npm install --prefix "$staging" --no-audit --no-fund --no-save --loglevel=error \
	--include=optional "$PACKAGE@$VERSION" >&2; then
	rm -rf "$staging"
	give_up "npm install $PACKAGE@$VERSION failed"
fi
rm -rf "$PREFIX"
mv "$staging" "$PREFIX"
[ "$(installed_version)" = "$VERSION" ] ||
	give_up "$CODEX does not run (the platform package with its native binary is missing?)"
