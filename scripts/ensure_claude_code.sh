#!/usr/bin/env bash
# The real Claude Code CLI for tests/test_claude_code.py (issue 38): npm's
# @anthropic-ai/claude-code at a pinned version, installed into the project-local
# .cache/claude-code (never globally, never into the user's home). Nothing to do where that
# version is installed there. The package is a native binary (its postinstall copies the
# platform's build over bin/claude.exe), so it needs no particular Node at run time, and in
# print mode it reaches nothing but ANTHROPIC_BASE_URL when the test's harness variables are
# set. Where npm is missing or the install fails this warns and exits 0, and the test skips
# with the reason; with ZEROHOP_REQUIRE_CLAUDE_CODE=1 (set by .ci/run) it fails instead, and
# so does the test, so CI cannot pass by skipping.
set -euo pipefail

VERSION="${CLAUDE_CODE_VERSION:-2.1.332}"
PACKAGE=@anthropic-ai/claude-code
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PREFIX="$ROOT/.cache/claude-code"
CLAUDE="$PREFIX/node_modules/.bin/claude"

give_up() {
	if [ "${ZEROHOP_REQUIRE_CLAUDE_CODE:-}" = 1 ]; then
		echo "ensure_claude_code: $1 (ZEROHOP_REQUIRE_CLAUDE_CODE=1)" >&2
		exit 1
	fi
	echo "ensure_claude_code: $1; the Claude Code test will skip" >&2
	exit 0
}

installed_version() {
	"$CLAUDE" --version 2>/dev/null | awk '{print $1}'
}

[ -x "$CLAUDE" ] && [ "$(installed_version)" = "$VERSION" ] && exit 0
command -v npm >/dev/null || give_up "npm is not installed (Claude Code comes from npm)"
echo "ensure_claude_code: installing $PACKAGE@$VERSION into $PREFIX with npm ..." >&2
# Into a staging folder first, so an interrupted install never looks installed.
staging="$PREFIX.staging"
rm -rf "$staging"
mkdir -p "$staging"
if ! npm install --prefix "$staging" --no-audit --no-fund --no-save --loglevel=error \
	"$PACKAGE@$VERSION" >&2; then
	rm -rf "$staging"
	give_up "npm install $PACKAGE@$VERSION failed"
fi
rm -rf "$PREFIX"
mv "$staging" "$PREFIX"
[ "$(installed_version)" = "$VERSION" ] ||
	give_up "$CLAUDE does not run (its postinstall did not put the native binary in place?)"
