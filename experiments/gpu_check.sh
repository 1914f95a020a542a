#!/usr/bin/env bash
# Every GPU path of attnres checked in one call, within 9 minutes on one H200; dry-run on the CPU
# (--dry) through the same code paths. docs/gpu.md is the user's guide.
#
#   experiments/gpu_check.sh --fetch-wheels          # here, where pip reaches PyPI: fill .whl/
#   experiments/gpu_check.sh                         # on the GPU machine (carry .whl/): all stages
#   experiments/gpu_check.sh --dry --out /tmp/gc     # on a CPU: every stage, tiny shapes
#   experiments/gpu_check.sh --stages c,d            # some stages only (a,b,c,d,e)
#
# Files, under --out DIR (default $OUT where set, else gpu_results/), each written when its stage
# ends, so a stage cut short by its time limit leaves what finished (at most 8 files: what a lent
# device machine sends back): stages.json, summary.md, log.txt, and
#   (a) a_tests.json    `-m gpu` over tests/, then tests/ops/test_kernels.py's Triton cases, on CUDA
#   (b) b_bench.json    experiments/bench_residuals.py on GPT-small, --modes compiled, then eager (eager also
#                       block-prenorm and full-prenorm: the pre-norm fused; the op alone also fused and
#                       composed, triton+norm and triton,norm); then experiments/bench_decode.py (KV-cached decoding and prefill, attnres and Hugging
#                       Face generate(), batch 1 and 8), its figures under "decode"
#   (c) c_runner.json   `attnres-run model=gpt-small` (python -m attnres), standard / Block N=8 / Full,
#                       bf16-mixed, 200 steps, compile=false then true; tokens/s, MFU, peak memory,
#                       and tokens/s over (b)'s bare train step on the same shape
#   (d) d_summary.md    a sweep sharing the GPU (jobs_per_gpu=2, standard and block, seeds 0 and 1)
#   (e) e_kernels.json  experiments/kernel_resources.py for the device's arch, and the kernels as loaded
#
# Time on one H200, per stage: limit / expected, and how the expectation is derived. Rates: bf16
# matrix products ~790 TFLOP/s and copies ~4.3 TB/s measured on these machines (device/KINDS.md);
# GPT-small (12 x 768, T 1024, B 16, vocab 32768) costs 6 (85M + 25M) + 12*12*1024*768 = 0.77 GFLOP
# per token, 12.7 TFLOP per train step: ~32 ms at 50% of the matrix rate (DESIGN.md section 4's
# ratios give Block ~1.2x, Full ~1.5-3x). The fixed costs are measured on the CPU dry run (a start
# of Python with torch, Lightning and Hydra ~6 s of CPU; the device's cores are faster) and
# torch.compile's are taken from published GPT-2-small figures (~40 s cold for a train graph on one
# H100-class GPU with 16 compile workers; ~10 s for an inference graph; the second and third
# strategy reuse the Transformer's Triton kernels from the on-disk cache: ~60%).
#   set-up     (rest) 15 s   preflight (import torch) + pip install of 11 small wheels + editable install
#   (a)         60 /  45 s   2 pytest starts (~6 s) + ~60 Triton variants compiled (0.2-0.5 s each,
#                            kernel_resources.py's figure, over 4 xdist workers) + 2 Inductor tests (~10 s)
#   (b)        175 / 170 s   compiled: start 8 + 3 train graphs (40 + 25 + 25) + 3 prefill graphs (10 + 5 + 5)
#                            + 3 x 13 steps (~0.1 s) = ~105 s; eager: start 8 + 5 x 13 train/prefill steps = ~25 s;
#                            decode (2 rounds): start 10 + per shape 3 strategies x (2 generate routes x 3 calls + 2
#                            interleaved passes) x 128 tokens x ~5 ms (eager decoding is launch-bound) = ~35 s
#   (c)        200 / 260 s   per run: start 8 + model init 3 + 200 steps x 40-60 ms + dashboards, probes,
#                            1.5 GB checkpoint x 2, validation = ~25 s; compile=true adds a train and an eval
#                            graph (50 s first, 30 s then): 3 x 25 + 3 x 25 + 50 + 30 + 30 = 260 s, so the
#                            last compiled run (Full) may be cut: c_runner.json then says so
#   (d)         50 /  45 s   4 tiny jobs, 2 at a time: 2 waves x (start 8 + 100 steps + validation) + summary
#   (e)         30 /  25 s   ~45 variants compiled for sm_90 (~0.3 s each, the dry run's) + the fast paths on
#                            the GPU and the loaded kernels read back
#   total      540 / 520 s   GPU_CHECK_BUDGET (default 540 s; 1200 with --dry) caps the whole: a stage gets at
#                            most what is left of it (less 15 s for its file), so the script ends within 9 minutes
# The dry run on this project's 2-core CPU (shared, busy), wall seconds: set-up 3, (a) 67, (b) 60 (eager
# only), (c) 136 (270 with a cold Inductor cache: Block's compile=true run 43 s warm, 176 s cold), (d) 94,
# (e) 38; 402 s in all, 2 min 53 s of CPU.
set -uo pipefail  # not -e: a stage that fails is recorded and the next one runs

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(dirname "$here")"
PY="${PYTHON:-python3}"
USAGE="usage: experiments/gpu_check.sh [--dry] [--out DIR] [--stages a,b,c,d,e] | --fetch-wheels"
declare -A LIMIT=([a]=60 [b]=175 [c]=200 [d]=50 [e]=30)  # + set-up and collection: 540 s
declare -A DRY_LIMIT=([a]=180 [b]=260 [c]=420 [d]=240 [e]=150)  # a CPU shared with others

say() { echo "gpu_check.sh: $*"; }
die() { echo "gpu_check.sh: error: $*" >&2; exit 2; }

# == inside a stage: its steps ======================================================================
# sub NAME SECONDS CMD...: run CMD with its own time limit, capped by what is left of the stage less
# $RESERVE seconds (kept for the steps after it); writes 'exit-status seconds limit' to NAME.rc and
# the command to NAME.cmd for gpu_check_collect.py. Not started (-1) when no time is left.
sub() {
  local name=$1 limit=$2
  shift 2
  local dir="$GC_SCRATCH/$GC_STAGE" left=$((GC_STAGE_END - $(date +%s) - 8 - ${RESERVE:-0}))
  ((GC_DRY)) && limit=$((limit * 5))  # a shared CPU: the stage's --dry limit governs
  ((limit > left)) && limit=$left
  printf '%q ' "$@" >"$dir/$name.cmd"
  if ((limit < 5)); then
    echo "== $name: not started, no time left in the stage" >&2
    echo "-1 0 0" >"$dir/$name.rc"
    return 1
  fi
  local start=$(date +%s)
  echo "== $name (limit $limit s): $*" >&2
  timeout -k 5 "$limit" "$@"
  local rc=$?
  echo "$rc $(($(date +%s) - start)) $limit" >"$dir/$name.rc"
  echo "== $name: exit $rc after $(($(date +%s) - start)) s" >&2
  return $rc
}

stage_a() {  # the GPU-marked tests, then the Triton cases of the kernel tests (on CUDA; interpreted with --dry)
  local d="$GC_SCRATCH/a" par=(-n 4)
  ((GC_DRY)) && par=(-p no:xdist)  # the CPU has 2 shared cores
  local common=(-m pytest -q -p no:cacheprovider --continue-on-collection-errors "${par[@]}")
  RESERVE=20 sub gpu 60 "$PY" "${common[@]}" -m gpu tests/ --junitxml="$d/gpu.xml"
  sub kernels 60 "$PY" "${common[@]}" -m "not gpu" -k triton tests/ops/test_kernels.py --junitxml="$d/kernels.xml"
}

stage_b() {  # bench_residuals.py on GPT-small (the --dry shape is tiny), compiled then eager; then decoding
  local d="$GC_SCRATCH/b" shape=() decode=(--shapes gpu-b1,gpu-b8 --rounds 2 --hf)
  if ((GC_DRY)); then
    shape=(--n-layer 2 --n-embd 32 --n-head 2 --seq-len 32 --batch 4 --vocab 64 --num-blocks 2 --steps 3
      --warmup 1 --kernel triton --threads 1)
    decode=(--shapes tiny --rounds 1 --hf --kernel triton --num-blocks 2 --threads 1)
  fi
  if [[ ",$GC_COMPILE," == *,b,* ]]; then
    RESERVE=75 sub compiled 100 "$PY" experiments/bench_residuals.py "${shape[@]}" --modes compiled --json "$d/compiled.json"
  else
    echo "== compiled: skipped (--dry compiles in the stages of GPU_CHECK_DRY_COMPILE=$GC_COMPILE)"
  fi
  # eager also with each sublayer's pre-norm fused into its depth mix (the strategies' default fuse_prenorm;
  # Triton fuses it in its one-query calls, the two-phase merges compose it) beside the unfused arms
  RESERVE=45 sub eager 60 "$PY" experiments/bench_residuals.py "${shape[@]}" --modes eager \
    --strategies standard,block,full,block-prenorm,full-prenorm --json "$d/eager.json"
  sub decode 45 "$PY" experiments/bench_decode.py "${decode[@]}" --json "$d/decode.json"
}

stage_c() {  # the runner for real: standard, Block N=8 and Full, bf16-mixed, eager then compile=true
  local d="$GC_SCRATCH/c" vocab=32768 T=1024 B=16 steps=200 blocks=8 skip=10 model=() trainer=(trainer=gpu)
  local limits=(45 100)
  if ((GC_DRY)); then
    vocab=64 T=32 B=4 steps=10 blocks=2 skip=3 limits=(90 200)
    model=(model.n_layer=2 model.n_embd=32 model.n_head=2 trainer.log_every_n_steps=1)
    trainer=()  # trainer=auto: the CPU
  fi
  "$PY" experiments/gpu_check_env.py tokens "$d/tokens" --vocab $vocab --train 1000000 --val 100000 || return 1
  local n_layer=12 n_embd=768 n_head=12
  ((GC_DRY)) && n_layer=2 n_embd=32 n_head=2
  printf '{"shape": {"batch": %d, "seq_len": %d, "vocab": %d, "n_layer": %d, "n_embd": %d, "n_head": %d}, ' \
    $B $T $vocab $n_layer $n_embd $n_head >"$d/setup.json"
  # the depth-attention implementation kernel=auto picks: Triton on CUDA, the C++ kernel on the CPU
  printf '"steps": %d, "skip_steps": %d, "num_blocks": %d, "kernel_resolved": "%s"}\n' $steps $skip $blocks \
    "$( ((GC_DRY)) && echo cpu || echo triton)" >>"$d/setup.json"
  local common=(model=gpt-small data=tokens "data.path=$d/tokens" data.block_size=$T data.batch_size=$B
    data.val_batches=2 trainer.precision=bf16-mixed trainer.max_steps=$steps trainer.val_check_interval=$steps
    trainer.enable_progress_bar=false logger=tensorboard callbacks.routing_probes.enabled=true
    callbacks.routing_probes.batches=1 callbacks.routing_probes.max_stack=2 seed=0)
  if ((GC_DRY)); then  # the device's command, composed (trainer=gpu cannot run here)
    sub cfg_gpu 60 "$PY" -m attnres "${common[@]}" trainer=gpu residual=block num_blocks=8 compile=true --cfg job \
      >"$d/cfg_gpu.yaml"
  fi
  local i=0 mode name extra
  for mode in eager compiled; do
    for name in standard block full; do
      extra=("residual=$name")
      [[ $name == block ]] && extra+=("num_blocks=$blocks")
      if [[ $mode == compiled ]]; then
        extra+=(compile=true)
        if ((GC_DRY)) && { [[ ",$GC_COMPILE," != *,c,* ]] || [[ $name != block ]]; }; then
          echo "== $name-$mode: skipped (--dry compiles Block only, in the stages of GPU_CHECK_DRY_COMPILE)"
          continue
        fi
      fi
      sub "$name-$mode" "${limits[$i]}" "$PY" -m attnres "${common[@]}" "${trainer[@]}" "${model[@]}" "${extra[@]}" \
        "hydra.run.dir=$d/runs/$name-$mode"
      rm -rf "$d/runs/$name-$mode/checkpoints"  # 1.5 GB each at GPT-small; the figures are in metrics.json
    done
    i=1
  done
}

stage_d() {  # a sweep sharing the GPU: two jobs per GPU, two strategies, two seeds, short
  local d="$GC_SCRATCH/d" args=(trainer=gpu) fake=()
  if ((GC_DRY)); then
    args=(model.n_layer=2 model.n_embd=32 model.n_head=2 num_blocks=2)
    fake=(env ATTNRES_FAKE_GPUS=1)  # the slots of one GPU (gpu0.0, gpu0.1) are planned; the jobs run on the CPU
  fi
  sub sweep 45 "${fake[@]}" "$PY" -m attnres -m residual=standard,block seed=0,1 \
    hydra.launcher.jobs_per_gpu=2 "hydra.launcher.lock_dir=$d/slots" "hydra.sweep.dir=$d/sweep" name=gpu_check \
    trainer.max_steps=$( ((GC_DRY)) && echo 4 || echo 100) trainer.val_check_interval=100 \
    trainer.enable_progress_bar=false data=synthetic data.val_batches=2 "${args[@]}"
}

stage_e() {  # kernel_resources.py for the device's architecture; the kernels as the device loaded them
  local d="$GC_SCRATCH/e" arch=90 shape=()
  ((GC_DRY)) && shape=(--d 64 --sublayers 4 --num-blocks 2)
  ((GC_DRY)) || arch=$("$PY" -c 'import torch; m, n = torch.cuda.get_device_capability(); print(10 * m + n)')
  RESERVE=10 sub resources 25 env -u TRITON_INTERPRET "$PY" experiments/kernel_resources.py --arch "$arch" \
    "${shape[@]}" >"$d/kernel_resources.txt"
  cat "$d/kernel_resources.txt"
  sub device 25 env -u TRITON_INTERPRET "$PY" experiments/gpu_check_device.py --json "$d/device.json" "${shape[@]}"
}

if [[ ${1:-} == --stage-body ]]; then  # gpu_check.sh runs each stage as `gpu_check.sh --stage-body X`
  cd "$repo" && "stage_$2"
  exit $?
fi

# == the wheels ====================================================================================
fetch_wheels() {  # pure-Python wheels for the device's Python 3.12; antlr4 4.9.3 is an sdist: built here
  cd "$repo" || exit 2
  mkdir -p .whl
  local reqs pure=() antlr=()
  mapfile -t reqs < <("$PY" experiments/gpu_check_env.py wheels) || die "cannot read pyproject.toml"
  for r in "${reqs[@]}"; do
    if [[ $r == antlr4-python3-runtime* ]]; then antlr+=("$r"); else pure+=("$r"); fi
  done
  "$PY" -m pip download -q --only-binary=:all: --python-version 3.12 --no-deps -d .whl "${pure[@]}" ||
    die "pip download failed (is PyPI reachable?)"
  "$PY" -m pip wheel -q --no-deps -w .whl "${antlr[@]}" || die "pip wheel ${antlr[*]} failed"
  say "wheels in $repo/.whl ($(du -sh .whl | cut -f1)):"
  ls .whl
}

install_missing() {  # only from .whl/, never from the network
  local needs
  mapfile -t needs < <("$PY" experiments/gpu_check_env.py needs)
  if ((${#needs[@]})); then
    [[ -d .whl ]] || die "missing ${needs[*]}, and no .whl/ here: run experiments/gpu_check.sh --fetch-wheels where pip reaches PyPI, and carry .whl"
    say "installing from .whl/: ${needs[*]}"
    timeout 120 "$PY" -m pip install -q --no-index --find-links .whl "${needs[@]}" ||
      die "installing ${needs[*]} from .whl/ failed (see above); refill it with experiments/gpu_check.sh --fetch-wheels"
  fi
  if ! "$PY" experiments/gpu_check_env.py installed; then
    say "installing attnres from this checkout (editable, no network)"
    timeout 120 "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e . ||
      die "pip install -e . failed (see above)"
  fi
}

# == one stage: its steps under its time limit, then its file ======================================
run_stage() {
  local stage=$1 limit=${LIMIT[$1]}
  ((GC_DRY)) && limit=${DRY_LIMIT[$1]}
  local left=$((script_end - $(date +%s) - 15))  # 15 s for the collection
  ((limit > left)) && limit=$left
  mkdir -p "$GC_SCRATCH/$stage"
  if ((limit < 10)); then
    say "($stage) not run: the budget of $budget s is spent"
    "$PY" experiments/gpu_check_collect.py "$stage" --out "$out" --scratch "$GC_SCRATCH"
    failed=1
    return
  fi
  local start=$(date +%s) rc secs
  say "($stage) started, limit $limit s"
  GC_STAGE=$stage GC_STAGE_END=$((start + limit)) timeout -k 10 "$limit" bash "$here/gpu_check.sh" --stage-body "$stage" \
    >"$GC_SCRATCH/$stage/stage.log" 2>&1
  rc=$?
  secs=$(($(date +%s) - start))
  timeout 60 "$PY" experiments/gpu_check_collect.py "$stage" --out "$out" --scratch "$GC_SCRATCH" --rc $rc \
    --seconds $secs --limit $limit || say "($stage) its file could not be written (see log.txt)"
  { echo "===== ($stage) exit $rc after $secs s (limit $limit s); the end of its log:"
    tail -n 60 "$GC_SCRATCH/$stage/stage.log"; } >>"$out/log.txt"
  ((rc == 0)) || failed=1
}

# == main ==========================================================================================
dry=0 out="" stages="a,b,c,d,e" fetch=0
while (($#)); do
  case $1 in
    --dry) dry=1 ;;
    --out) [[ $# -ge 2 ]] || die "--out needs a folder; $USAGE"; out=$2; shift ;;
    --stages) [[ $# -ge 2 ]] || die "--stages needs letters, e.g. --stages a,c; $USAGE"; stages=$2; shift ;;
    --fetch-wheels) fetch=1 ;;
    -h | --help) sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; echo "$USAGE"; exit 0 ;;
    *) die "unknown argument $1; $USAGE" ;;
  esac
  shift
done
if ((fetch)); then
  fetch_wheels
  exit $?
fi
[[ $stages =~ ^[a-e](,[a-e])*$ ]] || die "--stages takes letters among a,b,c,d,e separated by commas, got '$stages'"
out=${out:-${OUT:-gpu_results}}
mkdir -p "$out" || die "cannot create $out"
out=$(cd "$out" && pwd)
cd "$repo" || exit 2

export GC_DRY=$dry PY PYTHONUNBUFFERED=1
GC_SCRATCH=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check.XXXXXX") || die "no scratch folder"
export GC_SCRATCH GC_COMPILE=${GPU_CHECK_DRY_COMPILE:-c}  # --dry: the stages that compile (b,c: ~4 more minutes)
((dry)) || GC_COMPILE=b,c
[[ ${GPU_CHECK_KEEP:-0} == 1 ]] || trap 'rm -rf "$GC_SCRATCH"' EXIT
export ATTNRES_CACHE="$GC_SCRATCH/cache" ATTNRES_LOCK_DIR="$GC_SCRATCH/slots"  # nothing shared with other runs
if ((dry)); then
  # the Triton kernels in Triton's interpreter; one thread (a shared CPU); a nominal peak so that
  # MFU is computed (its value means nothing on a CPU)
  export TRITON_INTERPRET=1 OMP_NUM_THREADS=1 ATTNRES_PEAK_FLOPS=${ATTNRES_PEAK_FLOPS:-1e11}
fi
budget=${GPU_CHECK_BUDGET:-$( ((dry)) && echo 1200 || echo 540)}
script_start=$(date +%s)
script_end=$((script_start + budget))
echo "===== gpu_check.sh $( ((dry)) && echo --dry) --stages $stages, $(date '+%F %T')" >>"$out/log.txt"

"$PY" experiments/gpu_check_env.py preflight --out "$out" $( ((dry)) && echo --dry) || exit 2
install_missing
failed=0
for stage in a b c d e; do
  [[ ",$stages," == *",$stage,"* ]] && run_stage "$stage"
done
say "done in $(($(date +%s) - script_start)) s (budget $budget s); files in $out:"
ls "$out"
exit $failed
