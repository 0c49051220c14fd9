#!/usr/bin/env bash
# Second of the two staging calls (shared/gpu/README.md): the first copied .stage1's pieces to
# /tmp/site/.stage/parts; this one adds .stage2's, checks the archive against SHA256 (first
# argument), unpacks it and installs its wheels into /tmp/site, plus the small wheels of .whl/.
set -euo pipefail
cd "$(dirname "$0")/../.."
sha=${1:?usage: install_staged.sh SHA256}
H=/tmp/site/.stage
mkdir -p "$H/parts"
cp .stage2/wheels.tar.xz.part-* "$H/parts/"
cat "$H"/parts/wheels.tar.xz.part-* > "$H/wheels.tar.xz"
echo "$sha  $H/wheels.tar.xz" | sha256sum -c --quiet -
python3 -c 'import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), sys.stdout.buffer)' \
  "$H/wheels.tar.xz" | tar -xf - -C "$H"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$H"/whl/*.whl
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
rm -rf "$H"
echo "staged: $(ls /tmp/site | wc -l) entries in /tmp/site"
