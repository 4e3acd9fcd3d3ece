#!/usr/bin/env bash
# A folder holding this machine's `ip` and `tc` with every library they load and the dynamic
# loader itself, for a machine whose image has no iproute2 (scripts/lent_machine.sh's hosts
# step takes it as IPROUTE_DIR). bin/ip and bin/tc start the real programs through the
# folder's own loader: with only LD_LIBRARY_PATH pointing at the copied libc, the other
# image's loader and this libc disagree, and ip crashed (segmentation fault).
# Usage: bash scripts/pack_iproute.sh DIR
set -euo pipefail
dir=${1:?usage: pack_iproute.sh DIR}
mkdir -p "$dir/bin" "$dir/real" "$dir/lib"
loader=
for name in ip tc; do
    program=$(command -v "$name")
    cp "$program" "$dir/real/$name"
    for library in $(ldd "$program" | awk '/=>/ {print $3}'); do
        cp -L "$library" "$dir/lib/"
    done
    loader=$(ldd "$program" | awk '/ld-linux/ {print $1}')
    printf '#!/bin/sh\nd=$(dirname "$(readlink -f "$0")")/..\nexec "$d/lib/%s" --library-path "$d/lib" "$d/real/%s" "$@"\n' \
        "$(basename "$loader")" "$name" > "$dir/bin/$name"
    chmod +x "$dir/bin/$name"
done
cp -L "$loader" "$dir/lib/"
"$dir/bin/ip" -V
