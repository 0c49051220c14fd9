#!/usr/bin/env bash
# run_on_host.sh - the host side of scripts/amx/make_bundle.sh. Run it from the
# repo root on the (bare) AMX host, one device call per piece, back to back
# (the host keeps /tmp and /opt only while it stays warm between calls):
#
#   bash scripts/amx/run_on_host.sh K          K = 1..N, carry=[".amxK"]
#       K < N : copy .amxK/* into $AMX_PARTS and exit
#       K = N : also reassemble, check the sha256, unpack, relocate, and print
#               "AMX-READY ..." (idempotent: a second call is a no-op)
#   bash scripts/amx/run_on_host.sh test [pytest args]
#       run <venv>/bin/python -m pytest [args] from the repo root with CUDA
#       hidden, after printing the CPU's AVX-512/AMX flags and what torch says.
#   bash scripts/amx/run_on_host.sh check
#       the same header only (imports, paths, flags), no pytest.
# Both may follow the last piece in the same command:
#   bash scripts/amx/run_on_host.sh N && bash scripts/amx/run_on_host.sh test tests/e2e/...
#
# Layout after unpacking (AMX_ROOT is empty on the host; a local dry run sets
# it to a scratch folder, or runs in a mount namespace instead):
#   $AMX_ROOT/root/.pyenv/versions/3.11.7   the interpreter, at its build-time
#                                           prefix (its RUNPATH and sysconfig
#                                           name that path)
#   $AMX_ROOT/opt/amx/venv                  the venv; pyvenv.cfg, bin/python3
#                                           and script shebangs are rewritten
#                                           to these paths, and the editable
#                                           installs' finders to the repo copy
#                                           this script runs from ($REPO)
#   $AMX_ROOT/opt/amx/syslibs               bundled system libraries (libnuma,
#                                           libffi, ...); links to the ones
#                                           the host lacks go to .../opt/amx/lib,
#                                           which 'test' puts on LD_LIBRARY_PATH
#   $REPO/.venv -> $AMX_ROOT/opt/amx/venv   if $REPO/.venv does not exist
#   /work/main -> $REPO                     if /work/main does not exist and
#                                           AMX_ROOT is empty (nothing needs it
#                                           once the finders are rewritten; it
#                                           only keeps stray absolute paths
#                                           valid)
# Needs on the host: bash, coreutils, tar, and python3 (any 3.x: it streams the
# .xz through the lzma module when there is no xz binary).
set -euo pipefail

REPO=$(pwd -P)
AMX_ROOT=${AMX_ROOT:-}
PARTS=${AMX_PARTS:-$AMX_ROOT/tmp/amx/parts}
PYPREFIX=$AMX_ROOT/root/.pyenv/versions/3.11.7
HOME_AMX=$AMX_ROOT/opt/amx
VENV=$HOME_AMX/venv
ORIG_PYPREFIX=/root/.pyenv/versions/3.11.7   # what the bundle was built from
ORIG_VENV=/work/main/.venv
ORIG_REPO=/work/main

say() { printf '[amx] %s\n' "$*"; }
die() { printf '[amx] ERROR: %s\n' "$*" >&2; exit 1; }

header() {
  say "host: $(uname -r) $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ *//') ($(nproc) cpus)"
  say "glibc: $(getconf GNU_LIBC_VERSION 2>/dev/null || echo '?')"
  say "cpu flags: $(grep -o 'avx512[a-z_0-9]*\|amx[a-z_0-9]*' /proc/cpuinfo | sort -u | tr '\n' ' ')"
  say "compilers: $(for c in gcc g++ cc c++; do command -v $c >/dev/null && printf '%s ' "$c"; done)(torch.compile's C++ codegen needs one)"
  CUDA_VISIBLE_DEVICES= "$VENV/bin/python" - <<'PY'
import sys, torch
print(f"[amx] python {sys.version.split()[0]} at {sys.executable}, prefix {sys.base_prefix}")
print(f"[amx] torch {torch.__version__}: amx_tile={torch.cpu._is_amx_tile_supported()} "
      f"avx512={torch.cpu._is_avx512_supported()} avx512_bf16={torch.cpu._is_avx512_bf16_supported()} "
      f"cuda={torch.cuda.is_available()} threads={torch.get_num_threads()}")
import vllm, transformers, asyncrl, asyncrl_vllm
from vllm import _custom_ops as ops
print(f"[amx] vllm {vllm.__version__} ({vllm.__file__}), transformers {transformers.__version__}, "
      f"asyncrl from {asyncrl.__file__}, onednn={getattr(ops, '_supports_onednn', None)}")
PY
}

env_setup() {
  [ -x "$VENV/bin/python" ] || die "not unpacked: run the piece calls first ($VENV missing)"
  export LD_LIBRARY_PATH="$HOME_AMX/lib:$PYPREFIX/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export CUDA_VISIBLE_DEVICES=
  unset PYTHONHOME PYTHONPATH
}

case ${1:-} in
  test)
    shift
    env_setup
    header
    cd "$REPO"
    exec "$VENV/bin/python" -m pytest -p no:cacheprovider "$@"
    ;;
  check)
    env_setup
    header
    exit 0
    ;;
  '' | *[!0-9]*)
    sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'
    exit 2
    ;;
esac

K=$1
SRC=$REPO/.amx$K
[ -d "$SRC" ] || die "$SRC is missing: name .amx$K in the call's carry list"
mkdir -p "$PARTS"
cp "$SRC"/* "$PARTS"/
say "piece $K copied: $(ls "$SRC" | tr '\n' ' ')($(du -cb "$PARTS"/amx.tar.xz.part* | tail -1 | cut -f1) bytes of parts so far)"
[ -f "$PARTS/N" ] || exit 0            # not the last piece
N=$(cat "$PARTS/N")
[ "$K" = "$N" ] || die "piece $K carries N=$N, expected K=N"

if [ -f "$HOME_AMX/.unpacked" ] && [ "$(cat "$HOME_AMX/.unpacked")" = "$(cat "$PARTS/amx.tar.xz.sha256")" ]; then
  say "already unpacked"
else
  # ---- reassemble + check
  have=$(ls "$PARTS"/amx.tar.xz.part* | wc -l)
  [ "$have" = "$N" ] || die "have $have of $N pieces in $PARTS (the host went cold between calls? start again at 1)"
  want=$(cat "$PARTS/amx.tar.xz.sha256")
  got=$(cat "$PARTS"/amx.tar.xz.part* | sha256sum | cut -d' ' -f1)
  [ "$got" = "$want" ] || die "sha256 mismatch: $got != $want"
  say "sha256 ok ($want)"

  # ---- unpack into a scratch folder, then move into place
  rm -rf "$HOME_AMX" "$PYPREFIX"
  mkdir -p "$HOME_AMX/unpack"
  if xz --version >/dev/null 2>&1; then
    cat "$PARTS"/amx.tar.xz.part* | xz -dc | tar -C "$HOME_AMX/unpack" -xf -
  else
    PY3=$(command -v python3 || command -v python) || die "no python3 and no xz on this host"
    cat "$PARTS"/amx.tar.xz.part* | "$PY3" -c '
import lzma, shutil, sys
d = lzma.LZMADecompressor()
src, out = sys.stdin.buffer, sys.stdout.buffer
while True:
    chunk = src.read(1 << 20)
    if not chunk:
        break
    out.write(d.decompress(chunk))
    while d.eof and d.unused_data:        # xz -T0 can write several streams
        rest = d.unused_data
        d = lzma.LZMADecompressor()
        out.write(d.decompress(rest))
' | tar -C "$HOME_AMX/unpack" -xf -
  fi
  mkdir -p "$(dirname "$PYPREFIX")"
  mv "$HOME_AMX/unpack/py" "$PYPREFIX"
  mv "$HOME_AMX/unpack/venv" "$VENV"
  mv "$HOME_AMX/unpack/syslibs" "$HOME_AMX/syslibs"
  mv "$HOME_AMX/unpack/MANIFEST" "$HOME_AMX/MANIFEST"
  rmdir "$HOME_AMX/unpack"

  # ---- relocate the venv
  sed -i "s|$ORIG_PYPREFIX|$PYPREFIX|g; s|$ORIG_VENV|$VENV|g" "$VENV/pyvenv.cfg"
  ln -sfn "$PYPREFIX/bin/python3" "$VENV/bin/python3"
  for f in "$VENV"/bin/*; do   # console scripts: '#!/work/main/.venv/bin/python3'
    [ -f "$f" ] && [ ! -L "$f" ] && head -c 64 "$f" | grep -q "^#!$ORIG_VENV/" &&
      sed -i "1s|^#!$ORIG_VENV/|#!$VENV/|" "$f"
  done
  SP=$VENV/lib/python3.11/site-packages
  sed -i "s|'$ORIG_REPO/|'$REPO/|g" "$SP"/__editable___*_finder.py
  sed -i "s|file://$ORIG_REPO\([/\"]\)|file://$REPO\1|g" "$SP"/*.dist-info/direct_url.json

  # ---- system libraries the host lacks (or whose libstdc++/libgcc is too old)
  mkdir -p "$HOME_AMX/lib"
  host_has() {  # soname [version tag it must define]
    local p
    for d in /lib/x86_64-linux-gnu /usr/lib/x86_64-linux-gnu /lib64 /usr/lib64 /lib /usr/lib; do
      p=$d/$1
      if [ -e "$p" ]; then
        [ -z "${2:-}" ] && return 0
        grep -aq "$2" "$p" && return 0
        return 1
      fi
    done
    return 1
  }
  need() { sed -n "s/^needs_$1=//p" "$HOME_AMX/MANIFEST"; }
  used=()
  for lib in "$HOME_AMX"/syslibs/*; do
    so=$(basename "$lib")
    tag=
    case $so in
      libstdc++.so.6) tag=$(need GLIBCXX) ;;
      libgcc_s.so.1) tag=$(need GCC) ;;
    esac
    if ! host_has "$so" "$tag"; then
      ln -sfn "$lib" "$HOME_AMX/lib/$so"
      used+=("$so")
    fi
  done
  say "bundled system libs used (host lacks them): ${used[*]:-none}"
  host_glibc=$(getconf GNU_LIBC_VERSION 2>/dev/null | awk '{print $2}')
  need_glibc=$(need GLIBC); need_glibc=${need_glibc#GLIBC_}
  if [ -n "$host_glibc" ] && [ "$(printf '%s\n%s\n' "$need_glibc" "$host_glibc" | sort -V | head -1)" != "$need_glibc" ]; then
    say "WARNING: host glibc $host_glibc is older than the $need_glibc the interpreter was built against"
  fi
  cat "$PARTS/amx.tar.xz.sha256" >"$HOME_AMX/.unpacked"
fi

# ---- repo-side links
if [ ! -e "$REPO/.venv" ] && [ ! -L "$REPO/.venv" ]; then
  ln -s "$VENV" "$REPO/.venv"
fi
if [ -z "$AMX_ROOT" ] && [ ! -e "$ORIG_REPO" ] && [ "$REPO" != "$ORIG_REPO" ]; then
  mkdir -p "$(dirname "$ORIG_REPO")" && ln -s "$REPO" "$ORIG_REPO"
fi
rm -f "$PARTS"/amx.tar.xz.part*   # free the disk; .unpacked remembers the sha
env_setup
"$VENV/bin/python" -c 'import torch, vllm, transformers, asyncrl' ||
  die "unpacked, but the imports fail (see above)"
say "AMX-READY python=$VENV/bin/python repo=$REPO pieces=$N"
