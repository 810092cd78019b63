#!/usr/bin/env bash
# The GPU checks in one call: the test suite on CUDA (Triton kernels compiled for
# real, not interpreted), then the loss and decoding reports. Each step has its own time
# limit so one slow step cannot take the others' results with it. Logs go to $OUT (or ./gpu_out).
#   bash benchmarks/gpu_check.sh            # tests loss profile decoding
#   bash benchmarks/gpu_check.sh "tests profile"   # chosen steps: tests | loss | profile | decoding | draw-sweep | host | generation | flashinfer
# Wheels in .whl/ (benchmarks/fetch_gpu_wheels.sh; carry ".whl") are installed first: FlashInfer for
# the flashinfer step, Liger-Kernel and Cut Cross-Entropy for the loss step's baselines.
set -u
OUT=${OUT:-gpu_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
steps=${1:-"tests loss profile decoding"}
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv
python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
# FlashInfer JIT-builds its samplers with nvcc on first use (~2 min on an H200 machine's 16 CPUs):
# when the flashinfer step is asked for, the build starts now, beside the other steps, and that
# step waits for it. It slows the test step's CPU-bound parts (the tests reached 97% of the GPU
# files in 185 s that way on an H200 machine), not the timed GPU steps.
fi_build=
if [[ " $steps " == *" flashinfer "* ]]; then
  timeout 400 python3 -m benchmarks.report_decoding --gpu --flashinfer --build-only > "$OUT/flashinfer_build.log" 2>&1 &
  fi_build=$!
fi
for step in $steps; do
  case $step in
    # test_gpu_compile is the CPU machines' stand-in for a real compile: here every kernel compiles for real.
    # test_train trains on the CPU (the entry points' default device; CI runs it): here it only
    # competed for the step's time (the first H100 run timed out at 91%).
    # -v: each failure is named as it happens, so a run cut off by the limit still says which.
    # Only the files whose cases run on the GPU (helpers.DEVICE): the CPU-only ones run in CI.
    # TESTS_K="scan_select or workspace": only those cases (pytest -k), when the whole list will not fit.
    # -m "slow or not slow": the slow tests too (the G-tests at the GPU's 10⁶ draws), which pyproject.toml deselects.
    tests) OMP_NUM_THREADS=2 timeout 200 python3 -m pytest -v -p no:cacheprovider -n 8 -rf --tb=short --durations=12 \
             -m "slow or not slow" \
             ${TESTS_K:+-k "$TESTS_K"} \
             tests/test_decoding_fused.py tests/test_fused_loss.py tests/test_generation.py tests/test_integration.py \
             tests/test_kernels.py tests/test_row_draw.py tests/test_workspace.py tests/test_inverse_cdf.py tests/test_lanes.py \
             tests/test_interpreter_sort.py tests/test_no_host_sync.py \
             2>&1 | tee "$OUT/tests.log" | grep -E "FAILED|ERROR|passed|failed|^[0-9.]+s " | tail -40 ;;
    loss) timeout 240 python3 -m benchmarks.report --gpu --json "$OUT/loss.json" 2>"$OUT/loss.err" | tee "$OUT/loss.md"; tail -5 "$OUT/loss.err" ;;
    profile) timeout 150 python3 -m benchmarks.profile_loss 2>&1 | tee "$OUT/profile.md" | tail -60 ;;
    # DECODING_VOCABS=50257,128256: a part of the grid.
    decoding) timeout 200 python3 -m benchmarks.report_decoding --gpu ${DECODING_VOCABS:+--vocabs "$DECODING_VOCABS"} 2>&1 | tee "$OUT/decoding.md" ;;
    # DRAW_TABLES=read-floor,scan (profile_decoding --tables) runs chosen tables, in that order.
    draw-sweep) timeout 200 python3 -m benchmarks.profile_decoding ${DRAW_TABLES:+--tables "$DRAW_TABLES"} 2>&1 | tee "$OUT/draw_sweep.md" ;;
    # The decoding step's host time alone (kernels stubbed, CUDA tensors): the wrapper's share of small-batch steps.
    host) timeout 60 python3 -m benchmarks.host_overhead 2>&1 | tee "$OUT/host.md" ;;
    generation) timeout 150 python3 -m benchmarks.report_generation --device cuda 2>&1 | tee "$OUT/generation.md" ;;
    # The samplers were built in the background (above); the table itself takes ~30 s.
    flashinfer) wait $fi_build; cat "$OUT/flashinfer_build.log"
                timeout 150 python3 -m benchmarks.report_decoding --gpu --flashinfer 2>&1 | tee "$OUT/flashinfer.md" ;;
  esac
  echo "step $step exit ${PIPESTATUS[0]}"
done
