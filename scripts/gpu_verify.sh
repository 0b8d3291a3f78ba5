#!/usr/bin/env bash
# The checks only a GPU exercises, in one run on a CUDA machine (no network needed there):
# builds jaxascend against that machine's jax, then
#   1. the arena's pinned registration (cudaHostRegister through dlopen'd libcudart) and a DMA
#      round trip through it (scripts/gpu_check.sh);
#   2. the pytest files whose code paths differ on a GPU: pinned arena, the gradient sink's
#      device->host path inside a GPU backward pass, instant offload on the real models, the
#      "offload" remat policy (device -> pinned_host activations), vertical micro-batches
#      (train.grad_accum: each layer's A micro-batches in turn, their gradient summed in float32);
#   3. a short offloaded training run with the compute params on the GPU: its first line names the
#      GPU backend (`backend: gpu, ...`) and metrics.jsonl carries device_mem_bytes (memory_stats);
#   4. the same run with offload.params: ssd (the parameter source's host callback feeding each
#      layer to the device) against the resident run: the losses must be equal;
#   5. offload.overlap on and off, weights resident and streamed: the losses must be equal;
#   6. chat fine-tuning (sft-tiny) with the held-out eval and end-of-run samples, resident and
#      streamed, generate on the result, and the decode / blocked-prefill / masked-loss tests on the GPU backend;
#   7. cuDNN's fused attention (jax.nn.dot_product_attention(implementation="cudnn"), what
#      model.attention auto/blockwise take on a GPU) against the dense reference in bfloat16 and
#      float16 at a few lengths (scripts/check_cudnn_attention.py: pass/fail, max errors; it skips,
#      saying why, where cuDNN attention is unavailable), then a short bf16 training run through it
#      against the same run with the pure-JAX attention.
#   8. fewer bytes (issue 39): the gradients in RAM (offload.gradients: host) against on SSD (losses
#      equal), a compensated bfloat16 master against float32 (losses within 1e-4), and the compact
#      state (compensated master, int8 moments, gradients in RAM) with the weights on SSD, overlapped.
#   9. bench_step on the GPU (0.54B shape, one round, weights on SSD): compute alone, float32 and the
#      compact state, each with its SSD bytes and floor (is the GPU's step I/O-bound?);
#  10. determinism: the tiny run twice with XLA's default GPU ops and twice with deterministic ones.
# Sections 1-6 and 8 compare runs for equal losses: they use the pure-JAX attention
# (JAXASCEND_ATTENTION_BACKEND=jax), since cuDNN's backward need not be bit-reproducible; section 7
# is where cuDNN runs. After the build the sections run side by side (one GPU, memory taken as
# needed: XLA_PYTHON_CLIENT_PREALLOCATE=false), each under GPU_VERIFY_SECTION_S seconds (default
# 420); the end prints every pass/FAIL line. Output goes to ${OUT:-/tmp/gpu_verify}, every file also
# in one gpu_verify.tgz there.
set -uo pipefail
cd "$(dirname "$0")/.."
res=${OUT:-/tmp/gpu_verify}  # what comes back: summary.txt, gpu_verify.tgz (every file), bench_step_gpu.json
out=$(mktemp -d /tmp/gpu_verify_files.XXXX)
mkdir -p "$res"
exec > >(tee -a "$res/summary.txt") 2>&1
export PYTHONUNBUFFERED=1
export JAXASCEND_ATTENTION_BACKEND=jax
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # the sections share the GPU
# The sections that compare runs for equal losses take XLA's deterministic GPU ops (its reductions
# and scatters are not run-to-run reproducible otherwise) and full float32 matmuls (XLA's GPU
# default is TF32, outside the float32 tolerances of the tests); the first H200 run, without them,
# had every equality fail in the 4th-5th digit. Section 10 measures both ways; 7 and 9 run without.
plain_xla_flags=${XLA_FLAGS:-}
export XLA_FLAGS="$plain_xla_flags --xla_gpu_deterministic_ops=true"
export JAX_DEFAULT_MATMUL_PRECISION=highest
py=${PYTHON:-python3}
section_s=${GPU_VERIFY_SECTION_S:-420}

# tiny_run NAME STEPS [--set ...]: the tiny config in bf16, offloaded, logging every step, into
# /tmp/NAME (its console in $out/NAME.txt); later --set values win.
tiny_run() {
  local name=$1 steps=$2; shift 2
  rm -rf "/tmp/$name"
  $py -m jaxascend.train --config configs/tiny.yaml --set train.steps="$steps" --set train.log_every=1 \
      --set optimizer.warmup_steps=2 --set train.out_dir="/tmp/$name" --set offload.enabled=true \
      --set offload.dir="/tmp/$name/offload" --set model.dtype=bfloat16 --set train.progress=false "$@" \
      >"$out/$name.txt" 2>&1
}
# check: runs the Python on stdin with rows(NAME) (the records of /tmp/NAME/metrics.jsonl, or why
# there are none, through jaxascend.plot's reader) and losses(NAME) defined.
read_runs='from jaxascend.plot import PlotError, metrics_file, read_metrics
def rows(name):
    try:
        return list(read_metrics(metrics_file(f"/tmp/{name}")).values())
    except PlotError as err:
        return f"no metrics ({err})"
def losses(name):
    r = rows(name)
    return r if isinstance(r, str) else [x["loss"] for x in r]'
check() { { printf '%s\n' "$read_runs"; cat; } | $py - "$@"; }
{ nvidia-smi -L; $py --version; $py -c "import jax; print('jax', jax.__version__, jax.devices())"; } 2>&1 | tee "$out/env.txt"
echo "== build" | tee "$out/build.txt"
if [ -z "${GPU_VERIFY_SKIP_BUILD:-}" ]; then  # set it to check the script's plumbing where jaxascend is built
  $py -m pip install --no-build-isolation --no-deps -e . >>"$out/build.txt" 2>&1 || { tail -40 "$out/build.txt"; exit 1; }
fi
tail -2 "$out/build.txt"

sec_tests() {
echo "== pinned arena (C++)"
bash scripts/gpu_check.sh 256 2>&1 | tee "$out/pinned_check.txt"
echo "== pytest on the GPU backend"
$py -m pytest -p no:cacheprovider -q -rs tests/ssd/test_arena.py tests/offload/test_grad_sink.py tests/offload/test_step.py \
    "tests/models/test_models.py::test_remat_policy_matches_no_remat" \
    "tests/offload/test_streamed_params.py::test_streamed_weights_match_resident_bit_for_bit" \
    "tests/offload/test_vertical_micro_batches.py::test_vertical_micro_batches_equal_one_batch_of_all_rows" \
    2>&1 | tee "$out/pytest.txt" | tail -25
}

sec_train() {
echo "== offloaded training, compute params on the GPU"
rm -rf /tmp/gpu_run
$py -m jaxascend.train --config configs/tiny.yaml --set train.steps=20 --set train.log_every=5 --set optimizer.warmup_steps=5 \
    --set train.out_dir=/tmp/gpu_run --set offload.enabled=true --set offload.dir=/tmp/gpu_run/offload \
    --set model.dtype=bfloat16 --set train.progress=false 2>&1 | tee "$out/train.txt" | tail -20
$py - <<'PY' 2>&1 | tee -a "$out/train.txt"
import json
rows = [json.loads(l) for l in open("/tmp/gpu_run/metrics.jsonl")]
print("losses", [round(r["loss"], 4) for r in rows], "arena_pinned", rows[-1].get("arena_pinned"))
PY
echo "== the run's first line names the GPU backend; metrics.jsonl carries the device's memory"
first=$(grep -m1 '^backend: ' "$out/train.txt")  # stdout's first line (stderr's notes share train.txt)
echo "$first" | tee -a "$out/train.txt"
case "$first" in "backend: gpu, "*) echo "first line names the GPU backend: pass";; *) echo "first line: FAIL";; esac \
    | tee -a "$out/train.txt"
$py - <<'PY' 2>&1 | tee -a "$out/train.txt"
import json
rows = [json.loads(l) for l in open("/tmp/gpu_run/metrics.jsonl")]
fields = ("device_mem_bytes", "device_mem_peak_bytes", "device_mem_capacity_bytes")
print("device memory (GiB):", [[round(r.get(f, -2**30) / 2**30, 2) for f in fields] for r in rows])
ok = all(0 < r.get("device_mem_bytes", 0) <= r.get("device_mem_peak_bytes", 0) < r.get("device_mem_capacity_bytes", 0)
         for r in rows)
print("metrics.jsonl carries device_mem_bytes <= device_mem_peak_bytes < capacity:", "pass" if ok else "FAIL")
PY
echo "== offloaded training, params streamed from SSD to the GPU layer by layer"
rm -rf /tmp/gpu_run_ssd
$py -m jaxascend.train --config configs/tiny.yaml --set train.steps=20 --set train.log_every=5 --set optimizer.warmup_steps=5 \
    --set train.out_dir=/tmp/gpu_run_ssd --set offload.enabled=true --set offload.dir=/tmp/gpu_run_ssd/offload \
    --set model.dtype=bfloat16 --set train.progress=false --set model.remat=full --set offload.params=ssd \
    2>&1 | tee "$out/train_ssd.txt" | tail -20
$py - <<'PY' 2>&1 | tee -a "$out/train_ssd.txt"
import json
rows = [json.loads(l) for l in open("/tmp/gpu_run_ssd/metrics.jsonl")]
print("losses", [round(r["loss"], 4) for r in rows], "fetches", rows[-1].get("param_source_fetches"),
      "misses", rows[-1].get("param_source_misses"), "wait_s", rows[-1].get("param_source_wait_seconds"))
PY
}

sec_overlap() {
echo "== overlapped step (offload.overlap): the optimizer on a thread beside the next forward; losses must equal the sequential run's"
for placement in resident ssd; do
  for ov in false true; do
    rm -rf /tmp/gpu_run_ov_${placement}_$ov
    $py -m jaxascend.train --config configs/tiny.yaml --set train.steps=10 --set train.log_every=1 --set optimizer.warmup_steps=2 \
        --set train.out_dir=/tmp/gpu_run_ov_${placement}_$ov --set offload.enabled=true \
        --set offload.dir=/tmp/gpu_run_ov_${placement}_$ov/offload --set model.dtype=bfloat16 --set train.progress=false \
        --set model.remat=dots --set offload.params=$placement --set offload.overlap=$ov >"$out/train_ov_${placement}_$ov.txt" 2>&1
  done
  $py - "$placement" <<'PY' 2>&1 | tee -a "$out/train_overlap.txt"
import json, sys
p = sys.argv[1]
a = [json.loads(l) for l in open(f"/tmp/gpu_run_ov_{p}_false/metrics.jsonl")]
b = [json.loads(l) for l in open(f"/tmp/gpu_run_ov_{p}_true/metrics.jsonl")]
print(p, "losses equal:", [r["loss"] for r in a] == [r["loss"] for r in b], "overlap:", b[-1].get("overlap"),
      "early arrivals:", b[-1].get("early_gradient_arrivals"), "overlap_fraction:", b[-1].get("overlap_fraction"))
PY
done
}

sec_sft() {
echo "== chat fine-tuning with held-out eval and end-of-run samples on the GPU (resident and streamed), then generate"
for placement in resident ssd; do
  rm -rf /tmp/gpu_sft_$placement
  $py -m jaxascend.train --config configs/sft-tiny.yaml --set train.steps=30 --set eval.every_steps=10 \
      --set train.out_dir=/tmp/gpu_sft_$placement --set train.progress=false --set model.remat=dots \
      --set offload.params=$placement >"$out/sft_$placement.txt" 2>&1
  tail -16 "$out/sft_$placement.txt"
  $py -m jaxascend.generate --checkpoint /tmp/gpu_sft_$placement --chat "What is the capital of Japan?" \
      --max-new-tokens 40 2>&1 | tee "$out/generate_$placement.txt"
done
$py -m pytest -p no:cacheprovider -q -rs tests/models/test_decode.py tests/test_blocked_prefill.py tests/offload/test_masked_loss_and_eval.py \
    2>&1 | tee "$out/pytest_sft.txt" | tail -8
}

sec_cudnn() {
export XLA_FLAGS="$plain_xla_flags"; unset JAX_DEFAULT_MATMUL_PRECISION
echo "== cuDNN attention against the dense reference (bfloat16, float16; T = 128, 1000, 4096)"
JAXASCEND_ATTENTION_BACKEND=auto $py scripts/check_cudnn_attention.py --out "$out/cudnn_attention.json" 2>&1 \
    | tee "$out/cudnn_attention.txt" | tail -30
echo "== training through cuDNN attention (twice) against the pure-JAX attention: tiny, bf16, 20 steps"
for run in cudnn_a cudnn_b jax; do
  backend=auto; [ "$run" = jax ] && backend=jax
  JAXASCEND_ATTENTION_BACKEND=$backend tiny_run gpu_attn_$run 20 --set optimizer.warmup_steps=5
  grep "note: attention" "$out/gpu_attn_$run.txt"  # a fallback from cuDNN says why here
done
check <<'PY' 2>&1 | tee -a "$out/train_attention.txt"
a, b, ref = losses("gpu_attn_cudnn_a"), losses("gpu_attn_cudnn_b"), losses("gpu_attn_jax")
print("cuDNN losses", a if isinstance(a, str) else [round(x, 4) for x in a])
print("pure-JAX losses", ref if isinstance(ref, str) else [round(x, 4) for x in ref])
if not any(isinstance(x, str) for x in (a, b, ref)):
    worst = max(abs(x - y) / abs(y) for x, y in zip(a, ref))
    print(f"cuDNN vs pure-JAX: max relative loss difference {worst:.2e}:", "pass" if worst <= 2e-2 else "FAIL",
          "(bound 2e-2: bf16 trajectories drift apart)")
    print("cuDNN run twice, losses equal (bit-reproducible):", a == b)
PY
}

sec_bytes() {
echo "== fewer bytes (issue 39): gradients in RAM, a compensated bfloat16 master, the compact state on SSD"
for run in grads_ssd grads_host comp_host compact_ssd; do
  case $run in
    grads_ssd) extra="--set offload.gradients=ssd";;
    grads_host) extra="--set offload.gradients=host";;
    comp_host) extra="--set offload.gradients=host --set optimizer.master_dtype=bfloat16 --set optimizer.master_rounding=compensated";;
    compact_ssd) extra="--set offload.gradients=host --set optimizer.master_dtype=bfloat16 --set optimizer.state_dtype=int8 --set offload.params=ssd --set offload.overlap=true --set model.remat=dots";;
  esac
  tiny_run gpu_bytes_$run 12 $extra
  grep -E "^(note|error): " "$out/gpu_bytes_$run.txt" | head -5
done
check <<'PY' 2>&1 | tee -a "$out/train_bytes.txt"
r = {k: rows(f"gpu_bytes_{k}") for k in ("grads_ssd", "grads_host", "comp_host", "compact_ssd")}
for k, v in r.items():
    print(k, v if isinstance(v, str) else [round(x["loss"], 4) for x in v],
          "" if isinstance(v, str) else f"ssd bytes/step {v[-1].get('ssd_read_bytes', 0) + v[-1].get('ssd_written_bytes', 0)}")
if not any(isinstance(v, str) for v in r.values()):
    loss = {k: [x["loss"] for x in v] for k, v in r.items()}
    print("gradients in RAM vs on SSD, losses equal:", "pass" if loss["grads_host"] == loss["grads_ssd"] else "FAIL")
    worst = max(abs(a - b) / abs(b) for a, b in zip(loss["comp_host"], loss["grads_host"]))
    print(f"compensated bfloat16 master vs float32, max relative loss difference {worst:.1e}:",
          "pass" if worst <= 1e-4 else "FAIL", "(bound 1e-4: ties round away from zero, not to even)")
    c = loss["compact_ssd"]
    print("compact state, weights on SSD, overlapped: finite and falling:",
          "pass" if all(x == x and abs(x) < 1e9 for x in c) and c[-1] < c[0] else "FAIL")
PY
}

sec_bench() {
export XLA_FLAGS="$plain_xla_flags"; unset JAX_DEFAULT_MATMUL_PRECISION
echo "== bench_step on the GPU, 0.54B shape, weights on SSD: float32 against the compact state (one round)"
$py scripts/bench_step.py --rounds 1 --peer off --io-size 1GiB --work-dir /tmp/gpu_bench_step \
    --contenders compute,overlap_ssd,overlap_ssd_compact,overlap_ssd_compact_host --out "$out/bench_step_gpu.json" \
    2>&1 | grep -aE "^round|Error|error" | tee "$out/bench_step_gpu.txt"
$py - "$out/bench_step_gpu.json" <<'PY' 2>&1 | tee -a "$out/bench_step_gpu.txt"
import json, sys
try:
    s = json.load(open(sys.argv[1]))["summary"]
except (OSError, ValueError, KeyError) as err:
    sys.exit(f"bench_step: no summary ({err})")
for k in ("step_seconds", "ssd_bytes_per_step", "contender_ssd_floor_seconds"):
    print(k, {c: round(v["median"], 3) for c, v in s.get(k, {}).items()})
print("ratios", {k: round(v["median"], 3) for k, v in s.get("ratios", {}).items()})
PY
}

sec_determinism() {
echo "== determinism: the same tiny run twice, with XLA's defaults and with deterministic ops"
for mode in plain_a plain_b det_a det_b; do
  flags="$plain_xla_flags"; [ "${mode%_*}" = det ] && flags="$plain_xla_flags --xla_gpu_deterministic_ops=true"
  XLA_FLAGS="$flags" tiny_run gpu_det_$mode 8
done
check <<'PY' 2>&1 | tee -a "$out/train_determinism.txt"
for kind in ("plain", "det"):
    a, b = losses(f"gpu_det_{kind}_a"), losses(f"gpu_det_{kind}_b")
    print(f"{kind}: run twice, losses equal (bit-reproducible): {a == b}", a if isinstance(a, str) else "")
a, b = losses("gpu_det_det_a"), losses("gpu_det_plain_a")
if not any(isinstance(x, str) for x in (a, b)):
    print(f"deterministic vs default, max relative loss difference {max(abs(x - y) / abs(y) for x, y in zip(a, b)):.1e}")
PY
}

export -f sec_tests sec_train sec_overlap sec_sft sec_cudnn sec_bytes sec_bench sec_determinism tiny_run check
export plain_xla_flags read_runs
export out py
echo "== sections side by side (each at most ${section_s} s): tests train overlap sft cudnn bytes bench determinism"
started=$(date +%s)
pids=()
for name in tests train overlap sft cudnn bytes bench determinism; do
  ( timeout --kill-after=10 "$section_s" bash -c "sec_$name" >"$out/section_$name.log" 2>&1
    echo "$name exit $?" >>"$out/section_status.txt" ) &
  pids+=($!)
done
wait "${pids[@]}"  # not a bare wait: that would also wait for the tee behind summary.txt
cat "$out/section_status.txt"
echo "sections done in $(( $(date +%s) - started )) s"
for name in tests train overlap sft cudnn bytes bench determinism; do
  echo "---- section $name (exit status in section_status.txt)"
  grep -aE "pass|FAIL|passed|failed|error|skipped|losses equal|max relative|Error|^round|ratios|_seconds|ssd_bytes|bit-reproducible" "$out/section_$name.log" | grep -av "^note" | head -40
done
tar -czf "$res/gpu_verify.tgz" -C "$out" . 2>/dev/null
cp "$out/bench_step_gpu.json" "$res/" 2>/dev/null
echo "all output: $res/gpu_verify.tgz"
