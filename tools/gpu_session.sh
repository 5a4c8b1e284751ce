#!/usr/bin/env bash
# Issue #18's GPU measurements in two stages of under 10 minutes each (one device call each):
#
#   bash tools/gpu_session.sh correctness OUT   # attention check, Multi30k cuDNN run, tests
#   bash tools/gpu_session.sh speed OUT         # step-speed sweep and a profiled step
#
# OUT collects the logs. Needs ml_collections, rouge-score and nltk where the image lacks them
# (carried as wheels in .whl/) and, for the Multi30k run, the corpus in .gpudata/multi30k/.
# Copy the numbers into benchmarks/RESULTS.md (GPU section) with the device and jax version.
set -uo pipefail
cd "$(dirname "$0")/.."
stage=${1:-} out=${2:-/tmp/gpu_session}
if [[ $stage != correctness && $stage != speed ]]; then
  echo "usage: $0 correctness|speed OUT" >&2
  exit 2
fi
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/gpu.txt"
python3 -c "import jax; print('jax', jax.__version__, jax.devices())" | tee -a "$out/gpu.txt"
case $stage in
  correctness)
    python3 benchmarks/attention_check.py --speed 2>&1 | tee "$out/attention.log"
    if [[ -d .gpudata/multi30k ]]; then
      timeout 150 python3 -m transformer_jax.main --config configs/multi30k.py \
          --workdir /tmp/m30k_cudnn --config.data_dir=.gpudata/multi30k \
          --config.model.dtype=bfloat16 --config.model.attention_implementation=cudnn \
          --config.num_train_steps=200 --config.eval_every_steps=200 \
          --config.checkpoint_every_steps=200 --config.num_generate_examples=64 \
          --config.log_every_steps=50 > "$out/m30k_cudnn.log" 2>&1
      grep -E "step [0-9]+/|eval:|Error" "$out/m30k_cudnn.log" | tail -6
    fi
    time timeout 300 bash tools/test_gpu.sh 2>&1 | tee "$out/tests.log" | tail -30
    ;;
  speed)
    bash benchmarks/step_sweep.sh baseline unsafe_rbg cudnn_unsafe_rbg no_dropout \
        unsafe_rbg+no_triton_gemm 2>&1 | tee "$out/sweep.log"
    python3 -m transformer_jax.benchmark --config configs/wmt14_en_de.py --batch_size 128 \
        --seq_len 256 --decode=false --steps 10 --profile_dir /tmp/trace > "$out/profiled.log" 2>&1
    python3 benchmarks/trace_summary.py /tmp/trace --top 30 | tee "$out/trace_summary.txt"
    ;;
esac
