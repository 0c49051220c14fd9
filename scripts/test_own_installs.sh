#!/usr/bin/env bash
# Each optional distribution installed and tested on its own (issue 50): for asyncrl-torch,
# asyncrl-gateway and asyncrl-trackers in turn, a fresh venv with nothing but the core
# (asyncrl) and that distribution with its `test` extra, then its own tests
# (`<distribution>/tests`) run twice with that venv's python: from the distribution's
# directory and from the repository's root (the rootdir either way: the root's
# pyproject.toml holds the pytest config). A test that imports something the distribution
# and its extra do not install fails here, not on a user's install.
#
# NOT part of CI: scripts/test.sh and .ci/run do not call it (it installs three venvs, about
# 3 min and 1.5 GB with a CPU torch); run it after changing a distribution's dependencies,
# its extras or what its tests import. CI runs the same tests in the unit stage, in .venv
# where everything is installed.
#
#   bash scripts/test_own_installs.sh                  # all three
#   bash scripts/test_own_installs.sh gateway torch    # some: torch, gateway, trackers
#   KEEP=1 bash scripts/test_own_installs.sh trackers  # keep the venvs (printed) to look into
#
# The venvs live in one temporary directory, removed at exit (unless KEEP=1). asyncrl-torch's
# venv gets the CPU build of torch first ($TORCH, by default vLLM's pin in install.sh); where
# pip cannot find it, point pip at PyTorch's CPU index:
#   export PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
TORCH=${TORCH:-torch==2.13.0+cpu}
if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "asyncrl needs Python >= 3.11 (found $("$PY" --version))" >&2
  exit 1
fi

declare -A DIST=([torch]=backends/asyncrl-torch [gateway]=plugins/asyncrl-gateway
                 [trackers]=plugins/asyncrl-trackers)
declare -A FIRST=([torch]="$TORCH")  # installed before the distribution, in the same pip run
FIRST_PARTY=(asyncrl_torch asyncrl_gateway asyncrl_trackers asyncrl_example_backend
             asyncrl_vllm asyncrl_fsdp asyncrl_deepspeed asyncrl_arith asyncrl_sampler_dapo)

names=("$@")
[ ${#names[@]} -gt 0 ] || names=(torch gateway trackers)
for name in "${names[@]}"; do
  [ -n "${DIST[$name]:-}" ] || { echo "unknown distribution '$name' (torch, gateway, trackers)" >&2; exit 2; }
done

work=$(mktemp -d "${TMPDIR:-/tmp}/asyncrl-own-XXXXXX")
if [ -n "${KEEP:-}" ]; then
  trap 'echo "venvs kept in $work"' EXIT
else
  trap 'rm -rf "$work"' EXIT
fi

results=()
status=0
for name in "${names[@]}"; do
  dist=${DIST[$name]}
  venv=$work/$name
  echo "== $dist: a venv with asyncrl and ${dist##*/}[test] only ($venv)"
  "$PY" -m venv "$venv"
  # pip's notes about the local indexes' missing folders are noise here
  "$venv/bin/python" -m pip install --disable-pip-version-check -q ${FIRST[$name]:-} \
    -e "$ROOT" -e "$ROOT/$dist[test]" 2>&1 | { grep -v "^WARNING: Location '" || true; }
  own=asyncrl_${name}
  # nothing first-party but the core and this distribution
  "$venv/bin/python" - "$own" "${FIRST_PARTY[@]}" <<'EOF'
import importlib.util, sys
own, others = sys.argv[1], [m for m in sys.argv[2:] if m != sys.argv[1]]
found = [m for m in others if importlib.util.find_spec(m) is not None]
assert importlib.util.find_spec(own) is not None, f"{own} is not installed"
assert not found, f"installed beside {own}: {', '.join(found)}"
EOF
  for where in "$dist" .; do
    target=$([ "$where" = . ] && echo "$dist/tests" || echo tests)
    echo "-- in $where: pytest $target"
    code=0
    (cd "$ROOT/$where" && "$venv/bin/python" -m pytest -p no:cacheprovider -q "$target") \
      > "$work/$name.log" 2>&1 || code=$?
    tail -n 15 "$work/$name.log"
    results+=("$dist (from ${where/#./the root}): $(tail -n 1 "$work/$name.log" | tr -d '=')")
    [ "$code" -eq 0 ] || status=1
  done
  [ -n "${KEEP:-}" ] || rm -rf "$venv"  # ~1 GB for torch: gone before the next one
done
echo
echo "== each distribution on its own install"
printf '%s\n' "${results[@]}"
exit "$status"
