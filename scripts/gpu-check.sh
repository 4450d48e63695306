#!/usr/bin/env bash
# One call for a session on a CUDA machine (docs/cuda.md): what the GPU is, the GPU tests, the
# kernel microbenchmarks, the VRAM calibration, the end-to-end engine benchmark and FSDP2 sharding
# on one GPU against DDP (the 350M shape).
#
#   scripts/gpu-check.sh [STAGE ...]     stages: info tests bench vram engine sharding probe peers  (default: all)
#                                        issue 53's, run only when named: compiled batch16 probegap
#                                        issue 47's, run only when named: trace
#
# Installs nothing from the network: it expects torch (a CUDA build), CuPy and apr's pure-Python
# dependencies to be importable already, and puts this checkout first on PYTHONPATH (set
# APR_PIP_INSTALL=1 to `pip install -e . --no-deps` instead). Python: $PYTHON, else .venv/bin/python
# when that one sees CUDA, else python3.
#
# Results: every stage's output goes to the terminal and to $OUT/<stage>.log when $OUT is set
# (else ./gpu-check-out/), with JSON from the benchmarks, JUnit XML from pytest and summary.txt.
# Each stage runs under `timeout` ($APR_STAGE_TIMEOUT seconds, default 540) so one call per stage
# fits a 10-minute command limit. Exit status: 0 when every stage that ran passed.
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
OUT_DIR=${OUT:-$REPO/gpu-check-out}
mkdir -p "$OUT_DIR"
STAGE_TIMEOUT=${APR_STAGE_TIMEOUT:-540}
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export APR_HOME=${APR_HOME:-$OUT_DIR/apr-home}
export PYTHONDONTWRITEBYTECODE=1

if [[ -n "${PYTHON:-}" ]]; then
  PY=$PYTHON
elif [[ -x .venv/bin/python ]] && .venv/bin/python -c 'import torch,sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  PY=.venv/bin/python
else
  PY=python3
fi

STAGES=("$@")
[[ ${#STAGES[@]} -eq 0 ]] && STAGES=(info tests bench vram engine sharding probe peers)
# The test files that hold the `gpu`-marked tests and the CUDA compile checks: collecting the whole
# suite would import the dev-only extras (transformers, mlflow, playwright ...) a GPU image lacks.
GPU_TESTS=(tests/kernels/test_cupy_backend.py tests/kernels/test_cuda_compile.py tests/checkpoint/test_rng.py
           tests/train/test_nonfinite.py tests/distributed/test_sharding_one_rank.py)
# The 350M shape of configs/train/pretrain-350m-v2.yaml
SHAPE_350M=(--hidden 1024 --layers 24 --heads 16 --kv-heads 4 --intermediate 4096 --vocab 32768)
SUMMARY=$OUT_DIR/summary.txt
: >"$SUMMARY"
FAILED=0

banner() { printf '\n==> %s\n' "$*"; }

run_stage() {  # run_stage NAME COMMAND...: tee to $OUT_DIR/NAME.log, record pass/fail and duration
  local name=$1; shift
  banner "$name: $*"
  local start=$SECONDS rc
  if declare -F "$1" >/dev/null; then  # a shell function (quick): no timeout
    "$@" 2>&1 | tee "$OUT_DIR/$name.log"
  else
    timeout --kill-after=20 "$STAGE_TIMEOUT" "$@" 2>&1 | tee "$OUT_DIR/$name.log"
  fi
  rc=${PIPESTATUS[0]}
  local took=$((SECONDS - start))
  if [[ $rc -eq 0 ]]; then
    echo "$name: ok (${took}s)" | tee -a "$SUMMARY"
  else
    [[ $rc -eq 124 ]] && echo "$name: TIMED OUT after ${STAGE_TIMEOUT}s" | tee -a "$SUMMARY" \
                      || echo "$name: FAILED rc=$rc (${took}s)" | tee -a "$SUMMARY"
    FAILED=1
  fi
}

stage_info() {
  if command -v nvidia-smi >/dev/null; then
    nvidia-smi
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem --format=csv
  else
    echo "nvidia-smi not found"
  fi
  command -v nvcc >/dev/null && nvcc --version | tail -2
  "$PY" - <<'EOF'
import platform, sys
print("python", platform.python_version(), sys.executable)
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if not torch.cuda.is_available():
    sys.exit("torch sees no CUDA device")
p = torch.cuda.get_device_properties(0)
print("device", p.name, f"sm {p.major}.{p.minor}", p.multi_processor_count, "SMs", round(p.total_memory / 2**30, 1), "GiB")
missing = []
for mod in ("pydantic", "typer", "ruamel.yaml", "pyarrow", "safetensors", "numpy", "cel", "pytest"):
    try:
        __import__(mod)
    except Exception as err:
        missing.append(f"{mod} ({type(err).__name__})")
if missing:
    print("missing Python modules:", ", ".join(missing))
try:
    import cupy
    from cupy.cuda import nvrtc
    print("cupy", cupy.__version__, "nvrtc", nvrtc.getVersion())
except Exception as err:
    print("cupy: not usable:", type(err).__name__, err)
import apr
from apr.kernels import cupy_unavailable_reason, get_backend
reason = cupy_unavailable_reason()
print("apr", apr.__file__)
print("CuPy backend:", "ready (kernels compiled)" if reason is None else f"UNAVAILABLE: {reason}")
print("training.kernels: auto ->", get_backend("auto", "cuda").name)
sys.exit(1 if reason is not None or missing else 0)
EOF
}

stage_probe() {  # the plan, a probe on this GPU, and the plan again calibrated by it (350M)
  local cfg=configs/train/pretrain-350m-v2.yaml
  timeout --kill-after=20 "$STAGE_TIMEOUT" "$PY" -m apr train plan "$cfg" --probe --json
  echo "plan --probe exit $? (1 is expected where the config's data is not on this machine)"
  "$PY" -m apr train plan "$cfg"
  echo "plan exit $?"
  "$PY" -m apr calibration ls
}

stage_probegap() {  # issue 53: the probe's tokens/s against bench_engine's at the same shape (350M, 4 x 1024)
  local cfg=$REPO/configs/train/pretrain-350m-v2.yaml dir=$OUT_DIR/synth-350m
  "$PY" -m apr data synth --like "$cfg" --out "$dir" --train-rows 4000 --overwrite || return 1
  (cd "$dir" && timeout --kill-after=20 "$STAGE_TIMEOUT" "$PY" -m apr train plan "$cfg" --probe --json \
     >"$OUT_DIR/probe-350m.json")
  echo "plan --probe exit $? (the probe's measured step and tokens/s: $OUT_DIR/probe-350m.json)"
  "$PY" benchmarks/bench_engine.py --device cuda "${SHAPE_350M[@]}" --seq 1024 --batch 4 --warmup 3 --steps 10 \
    --only auto --json >"$OUT_DIR/bench-engine-auto-350m.json"
  echo "bench_engine auto exit $? ($OUT_DIR/bench-engine-auto-350m.json): compare its tokens/s with the probe's"
}

stage_trace() {  # issue 47: `plan --probe --trace` on this GPU: the plan, the engine's tensors on fake CUDA
  # tensors and the device's own measurement side by side (350M on stand-in data, a few policies);
  # trace-table.md holds the rows docs/performance.md ("Trace on a GPU") wants
  local cfg=$REPO/configs/train/pretrain-350m-v2.yaml dir=$OUT_DIR/synth-350m name settings rc files=()
  [[ -d $dir/data ]] || "$PY" -m apr data synth --like "$cfg" --out "$dir" --train-rows 4000 --overwrite || return 1
  # 4000 sequences: 1000 steps of batch 4 (the config's 5000 would be more steps than the data holds)
  local -a variants=(${APR_TRACE_VARIANTS:-350m 350m-recompute 350m-standard})
  # the CLI's trace on fake CUDA tensors (rank 0 of 2 under FSDP2): the path a CPU-only torch never takes
  "$PY" -m pytest -q -p no:cacheprovider "tests/test_trace.py::test_cli_trace_json_of_rank_zero_of_a_sharded_gpu_run" \
    || return 1
  for name in "${variants[@]}"; do
    case $name in
      350m) settings=() ;;
      350m-recompute) settings=(training.execution.activations=recompute) ;;
      350m-selective) settings=(training.execution.activations=selective) ;;
      350m-standard) settings=(training.engine=standard) ;;
      350m-bf16) settings=(training.mixed_precision=bf16) ;;
      *) echo "trace: unknown variant $name (350m 350m-recompute 350m-selective 350m-standard 350m-bf16)"; return 2 ;;
    esac
    (cd "$dir" && timeout --kill-after=20 "${APR_TRACE_TIMEOUT:-150}" "$PY" -m apr train plan "$cfg" \
       training.max_steps=1000 "${settings[@]}" --probe --probe-steps 3 --trace --json >"$OUT_DIR/trace-$name.json")
    rc=$?
    echo "trace $name: plan --probe --trace exit $rc ($OUT_DIR/trace-$name.json)"
    [[ $rc -eq 0 ]] && files+=("$OUT_DIR/trace-$name.json")
  done
  [[ ${#files[@]} -gt 0 ]] || return 1
  "$PY" benchmarks/bench_trace.py --probe-table "${files[@]}" | tee "$OUT_DIR/trace-table.md"
  [[ ${#files[@]} -eq ${#variants[@]} ]]
}

if [[ "${APR_PIP_INSTALL:-0}" == 1 ]]; then
  banner "pip install -e . --no-deps (no network needed)"
  "$PY" -m pip install -q --no-deps --no-build-isolation -e . || echo "pip install failed: using PYTHONPATH"
fi

for stage in "${STAGES[@]}"; do
  case $stage in
    info) run_stage info stage_info ;;
    tests) run_stage tests "$PY" -m pytest -q -p no:cacheprovider -rs \
             --junitxml="$OUT_DIR/pytest-gpu.xml" "${GPU_TESTS[@]}" ;;
    bench) run_stage bench "$PY" benchmarks/bench_kernels.py --json "$OUT_DIR/bench_kernels.json" ;;
    vram) run_stage vram "$PY" benchmarks/vram_calibration.py --json "$OUT_DIR/vram_calibration.json" ;;
    engine)
      if [[ -f benchmarks/bench_engine.py ]]; then
        # 350M at seq 1024 in bf16 against the plain loop, eager and compiled; MFU against the
        # H100/H200 bf16 dense peak
        run_stage engine "$PY" benchmarks/bench_engine.py --device cuda "${SHAPE_350M[@]}" --seq 1024 --batch 4 \
          --warmup 3 --steps 10 --peak-tflops "${APR_PEAK_TFLOPS:-989}" \
          --only "${APR_ENGINE_ONLY:-auto,lean/selective+adagc,standard,baseline,baseline+compile}"
      else
        echo "engine: skipped (no benchmarks/bench_engine.py)" | tee -a "$SUMMARY"
      fi ;;
    sharding) run_stage sharding "$PY" benchmarks/bench_sharding.py --device cuda "${SHAPE_350M[@]}" \
                --seq 1024 --batch 4 ;;
    probe) run_stage probe stage_probe ;;
    compiled)  # issue 53: apr compiled at the 350M config's own micro-batch (4 x 1024) against the compiled
      # loop, and lean mode against auto (targets: apr >= 1.0x baseline+compile, lean >= 0.8x auto)
      run_stage compiled "$PY" benchmarks/bench_engine.py --device cuda "${SHAPE_350M[@]}" --seq 1024 --batch 4 \
        --warmup 3 --steps 10 --peak-tflops "${APR_PEAK_TFLOPS:-989}" \
        --only "${APR_COMPILED_ONLY:-auto,auto+compile,lean/selective+adagc,baseline,baseline+compile}" ;;
    batch16)  # issue 53: MFU at batch 16 x 1024 (target >= 50%); the plain compiled loop beside
      run_stage batch16 "$PY" benchmarks/bench_engine.py --device cuda "${SHAPE_350M[@]}" --seq 1024 --batch 16 \
        --warmup 3 --steps 10 --peak-tflops "${APR_PEAK_TFLOPS:-989}" \
        --only "${APR_BATCH16_ONLY:-auto,auto+compile,baseline+compile}" ;;
    probegap) run_stage probegap stage_probegap ;;
    trace) run_stage trace stage_trace ;;
    peers)  # issue 40's GPU table: the loop, apr, litgpt and torchtitan's model at 350M, seq 1024, bf16;
      # a peer that is not importable here (pip install -e '.[bench]' where there is a network, or put
      # its packages on PYTHONPATH) is skipped with the reason
      run_stage peers "$PY" benchmarks/bench_peers_cuda.py --batch "${APR_PEERS_BATCH:-4}" --warmup 3 --steps 10 \
        --only "${APR_PEERS_ONLY:-baseline,apr,apr+compile,litgpt,litgpt+compile,torchtitan}" ;;
    *) echo "unknown stage $stage (info tests bench vram engine sharding probe peers compiled batch16 probegap trace)" >&2
       exit 2 ;;
  esac
done

banner "summary (also in $SUMMARY)"
cat "$SUMMARY"
exit $FAILED
