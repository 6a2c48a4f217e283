#!/usr/bin/env bash
# Every GPU check of the library and the PyTorch engine, in one run on a machine with an NVIDIA
# GPU, PyTorch and transformers, from what benches/gpu/pack.sh put in carry/: the CUDA tests of
# the library and of the Python package, bench-report's GPU section, and the PyTorch engine's
# figures (the demo's replication overhead and failures, swapping with swaps started ahead,
# disaggregation across a change of TP degree).
# Each check's output goes to $OUT/<check>.txt, and one line per check to $OUT/summary.txt.
# A check that would start after BUDGET_S seconds (default 480) is skipped, and says so.
#
#     OUT=gpu-out benches/gpu/verify.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-gpu-out}
BUDGET_S=${BUDGET_S:-480}
DEVICE=${DEVICE:-cuda}
mkdir -p "$OUT"
began=$(date +%s)

say() { echo "[$(($(date +%s) - began)) s] $*" | tee -a "$OUT/summary.txt"; }

# check NAME SECONDS COMMAND...: runs COMMAND for at most SECONDS, its output in $OUT/NAME.txt.
check() {
    local name=$1 limit=$2
    shift 2
    if (($(date +%s) - began + 20 > BUDGET_S)); then
        say "$name: skipped, the budget of $BUDGET_S s is spent"
        return
    fi
    timeout "$limit" "$@" >"$OUT/$name.txt" 2>&1
    local status=$?
    say "$name: exit status $status$( ((status == 124)) && echo " (ran past $limit s)")"
}

{ nvidia-smi -L || echo "no nvidia-smi"; lscpu | grep "Model name"; } >"$OUT/machine.txt" 2>&1
python3 -m pip install -q --no-index --no-deps --target carry/python carry/wheel/*.whl >"$OUT/install.txt" 2>&1 ||
    say "the wheel did not install: see install.txt"
export PYTHONPATH=$PWD/carry/python${PYTHONPATH:+:$PYTHONPATH}
export DEJAVUD=$PWD/carry/bin/dejavud
python3 -c "import torch, transformers, dejavu; print('torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())" >>"$OUT/machine.txt" 2>&1

check rust-cuda-tests 150 bash -c 'for t in carry/bin/test-*; do echo "== $t"; "$t" --test-threads 2 || exit 1; done'
check python-gpu-tests 240 python3 -m pytest -q -rs -p no:cacheprovider bindings/python/tests/test_dejavu.py \
    bindings/python/tests/test_torch_engine.py -k "cuda or gpu"
check bench-report-gpu 180 carry/bin/bench-report --gpu-only
# A 7B-class Llama in 2 stages of 16 layers on the one GPU, as docs/benchmarks.md's GPU sittings.
SEVEN_B=(--dtype bfloat16 --layers 32 --hidden 4096 --heads 32 --kv-heads 32 --intermediate 11008 --vocab 32000)
[[ $DEVICE == cpu ]] && SEVEN_B=(--layers 4 --hidden 128 --heads 4 --kv-heads 2 --intermediate 256 --vocab 512)
check torch-demo 240 python3 -m dejavu.torch_engine demo --device "$DEVICE" "${SEVEN_B[@]}" \
    --batch 8 --prompt 128 --new-tokens 48 --json "$OUT/torch-demo.json"
check torch-demo-swapping 240 python3 -m dejavu.torch_engine demo --device "$DEVICE" "${SEVEN_B[@]}" \
    --batch 8 --microbatches 4 --resident 2 --prompt 128 --new-tokens 24 --json "$OUT/torch-demo-swapping.json"
check torch-swap-prefetch 180 python3 benches/python/torch_swap_prefetch.py --device "$DEVICE" "${SEVEN_B[@]}" \
    --stages 2 --microbatches 4 --batch 8 --prompt 512 --new-tokens 12 --rounds 2
check torch-disaggregation 180 python3 benches/python/torch_disaggregation.py --device "$DEVICE" "${SEVEN_B[@]}" \
    --batch 4 --prompt 1024 --new-tokens 8 --rounds 2
say "done"
