#!/usr/bin/env bash
# Transformer-base training-step speed under variants, one process each (compile included):
#
#   bash benchmarks/step_sweep.sh VARIANT...     # names below; results as JSON lines + table
#
# Each variant is the issue #18 benchmark command plus flags or XLA_FLAGS. Prints one
# "variant<TAB>json" line per run and a table at the end; benchmarks/RESULTS.md has the numbers.
set -uo pipefail
cd "$(dirname "$0")/.."
BASE=(python3 -m transformer_jax.benchmark --config "${CONFIG:-configs/wmt14_en_de.py}" --batch_size "${BATCH:-128}"
      --seq_len "${SEQ:-256}" --decode=false --steps "${STEPS:-30}")
declare -A FLAGS=(
  [default]=""  # the config as it is: attention 'auto' (cuDNN on a GPU)
  [baseline]="--config.model.attention_implementation=xla"
  [rbg]="--config.model.attention_implementation=xla --config.prng_impl=rbg"
  [unsafe_rbg]="--config.model.attention_implementation=xla --config.prng_impl=unsafe_rbg"
  [cudnn]="--config.model.attention_implementation=cudnn"
  [cudnn_rbg]="--config.model.attention_implementation=cudnn --config.prng_impl=rbg"
  [cudnn_unsafe_rbg]="--config.model.attention_implementation=cudnn --config.prng_impl=unsafe_rbg"
  [no_dropout]="--config.model.attention_implementation=xla --config.model.dropout_rate=0"
  [cudnn_no_dropout]="--config.model.attention_implementation=cudnn --config.model.dropout_rate=0"
  [auto]="--config.prng_impl=unsafe_rbg"
  [jit]="--config.prng_impl=unsafe_rbg --config.parallel.mode=jit"
  # The output matmul with float32 operands (the code before issue #41; TF32 on a GPU).
  [f32_logits]="--config.model.logits_dot_in_float32=true"
  # Transformer-big (the paper's Table 3) at the same batch shape.
  [big]="--config.model.emb_dim=1024 --config.model.num_heads=16 --config.model.qkv_dim=1024
         --config.model.mlp_dim=4096 --config.model.dropout_rate=0.3"
  [batch256]="--batch_size 256"
)
declare -A XLA=(
  [no_triton_gemm]="--xla_gpu_enable_triton_gemm=false"
  [lhs]="--xla_gpu_enable_latency_hiding_scheduler=true"
  [autotune0]="--xla_gpu_autotune_level=0"
)
TABLE=()
for variant in "$@"; do
  # A variant is NAME or NAME+XLAOPT (XLAOPT a key of XLA above).
  name=${variant%%+*}; xla=""
  [[ $variant == *+* ]] && xla=${XLA[${variant#*+}]}
  out=$([[ -n $xla ]] && export XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }$xla"
        "${BASE[@]}" ${FLAGS[$name]} 2>&1 | tail -1)
  echo -e "$variant\t$out"
  TABLE+=("$(python3 - "$variant" "$out" <<'PY'
import json, sys
name, out = sys.argv[1], sys.argv[2]
try:
  r = json.loads(out)
  memory = (r["peak_memory_bytes"] or 0) / 2**30
  print(f"{name:28s} {1e3 * r['train_step_s']:7.1f} ms {100 * r['mfu']:5.1f}% MFU "
        f"{r['train_tokens_per_s'] / 1e3:6.0f}k tok/s compile {r['compile_s']:5.1f} s "
        f"peak {memory:5.1f} GiB")
except Exception:
  print(f"{name:28s} failed: {out[:300]}")
PY
)")
done
printf '%s\n' "${TABLE[@]}"
