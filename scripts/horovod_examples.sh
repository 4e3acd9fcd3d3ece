#!/usr/bin/env bash
# Run Horovod's example scripts, unchanged, against hororing under mpiexec: only the imports
# are redirected (scripts/horovod_shim: hororing's horovod alias, an offline MNIST stand-in, and for
# TF1-era Keras scripts TF1 behaviour with tf-keras as `keras`).
# Usage, from the project root after `source scripts/install.sh`:
#   bash scripts/horovod_examples.sh HOROVOD_CHECKOUT EXAMPLE [RANKS] [ARGS...]
#   EXAMPLE: a path under HOROVOD_CHECKOUT/examples, e.g. keras/keras_mnist.py
#   EXAMPLES_VENV=DIR: the environment whose mpiexec and Python run it (default .venv), e.g. a
#   fresh venv with the built wheel installed (the shim needs scikit-learn there)
# Each run works in its own temporary directory (the scripts write checkpoints there) and
# prints the script's last lines; the whole output is kept in the directory named.
set -euo pipefail
checkout=${1:?usage: horovod_examples.sh HOROVOD_CHECKOUT EXAMPLE [RANKS] [ARGS...]}
example=${2:?usage: horovod_examples.sh HOROVOD_CHECKOUT EXAMPLE [RANKS] [ARGS...]}
ranks=${3:-2}
shift $(( $# < 3 ? $# : 3 ))
root=$(cd "$(dirname "$0")/.." && pwd)
script=$checkout/examples/$example
[[ -f $script ]] || { echo "no $script"; exit 2; }
work=$(mktemp -d -t horovod-example.XXXX)
cp "$script" "$work/"
tf1=0
case $example in  # written for TensorFlow 1 and standalone Keras 2
    keras/*|tensorflow/*) tf1=1 ;;
esac
cd "$work"
start=$(date +%s)
venv=${EXAMPLES_VENV:-$root/.venv}
HORORING_AS_HOROVOD=1 HORORING_SHIM_TF1=$tf1 \
    PYTHONPATH="$root/scripts/horovod_shim${PYTHONPATH:+:$PYTHONPATH}" \
    TF_CPP_MIN_LOG_LEVEL=2 timeout -k 10 "${EXAMPLE_TIMEOUT:-3600}" \
    "$venv/bin/mpiexec" -n "$ranks" "$venv/bin/python" "$(basename "$script")" "$@" \
    > out.txt 2>&1 && rc=0 || rc=$?
echo "$example on $ranks rank(s): rc=$rc in $(( $(date +%s) - start )) s; log: $work/out.txt"
tr '\r' '\n' < out.txt | grep -E "Test (loss|accuracy)|^Epoch [0-9]+/|accuracy: [0-9.]+$|Error" \
    | grep -v "^Epoch" | tail -4
exit "$rc"
