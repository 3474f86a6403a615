#!/usr/bin/env bash
# The GPU check of the performance issue as one script: GPT-2 124M (model=gpt2_124m data=bpe50k) in bf16, eager and
# compiled, against Hugging Face's GPT2LMHeadModel; train.py as a user runs it (eager, compiled, trainer=fsdp2 on one
# GPU); the masked attention paths (a sliding window and document masks through FlexAttention, MLA); ffn=moe against
# the dense FFN. Every stage writes one JSON file into the output folder and its printed output to OUT/log.txt; the
# last step, `summary`, reads them all into OUT/summary.json (tokens/s, MFU, peak memory, the compiled step's split
# into GEMMs / attention / optimizer / other, the issue's targets) and prints it. docs/bench.md lists the files.
#
#   bash scripts/bench_gpu.sh OUT                       # the whole plan, about 10-12 minutes on one H100/H200
#   DEADLINE=570 bash scripts/bench_gpu.sh OUT --stages "env eager compiled train-eager"  # or: a first call (~5 min)
#   DEADLINE=570 bash scripts/bench_gpu.sh OUT --stages "train-compiled fsdp2 attention moe"  # and a second (~7 min)
#   bash scripts/bench_gpu.sh /tmp/bench-dry --dry-run  # the same stages at tiny sizes on the CPU (~2 minutes)
#
# Stages, in order (the default plan), with their time limits on the GPU (expected times in docs/bench.md):
#   env             versions, device, commit                                               -> env.json
#   eager           python -m lmlab.bench, GPT-2 124M, batch 32 x 1024, bf16, vs HF (150 s) -> gpt2-124m-eager.json
#   compiled        the same with --compile, its step profiled (240 s)                     -> gpt2-124m-compiled.json
#   train-eager     train.py model=gpt2_124m data=bpe50k trainer=gpu, 150 steps (150 s)     -> train-eager.json
#   train-compiled  the same with compile=true (210 s)                                     -> train-compiled.json
#   fsdp2           the same with trainer=fsdp2 trainer.devices=1, compiled (210 s)         -> train-fsdp2.json
#   attention       full causal / window 256 / documents / MLA at T 4096 and 16384 (240 s) -> attention.json
#   moe             ffn=moe (8 experts, top 1 and top 2) vs dense at GPT-2 124M sizes (150 s) -> moe.json
#   mixers          one GDN layer on its kernel (mixer.backend=auto: fla where installed) and on lmlab's PyTorch
#                   form against full attention (SDPA), T 2048 / 8192 / 32768, bf16 (240 s)  -> mixers.json
#   fp8             train-compiled with precision.fp8=[mlp,attn_qkv,attn_proj] over 768 features (210 s)
#                                                                                          -> train-fp8.json
# Optional (name them in --stages): chunked, chunked-compiled (model.chunked_loss=true), loop (the Lightning loop's
# cost over the bare step), llama, llama-compiled (the llama-like model vs LlamaForCausalLM).
# Settings: PEAK (TFLOP/s of the card's dense bf16 peak, default 989: H100/H200 SXM), DEADLINE (seconds for the whole
# call, default 720; a stage that would start past it is skipped), PY (python3). Offline: the corpus must already be
# in $LMLAB_CACHE (data=bpe50k trains its tokenizer on it: a few seconds). Exit status: 1 when a stage failed.
set -u
OUT=${OUT:-bench-gpu}
DRY=0
STAGES=${STAGES:-env eager compiled train-eager train-compiled fsdp2 attention moe mixers fp8}
while (( $# )); do
    case $1 in
        --dry-run) DRY=1 ;;
        --stages) STAGES=$2; shift ;;
        -h|--help) sed -n '2,31p' "$0"; exit 0 ;;
        -*) echo "bench_gpu.sh: unknown option $1" >&2; exit 2 ;;
        *) OUT=$1 ;;
    esac
    shift
done
PEAK=${PEAK:-989}
PY=${PY:-python3}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 PYTHONPATH=".:${PYTHONPATH:-}" TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/inductor}
RUNS=${RUNS:-/tmp/lmlab-gpu-runs}
FAILED=()

if (( DRY )); then  # every stage's command line, config keys and JSON, at sizes a CPU runs in seconds
    # compiled stages trace and differentiate the same graphs but run them on eager kernels: on a CPU Inductor would
    # build C++, not the GPU's Triton (Inductor on the CPU is tested against eager in tests/e2e/model/test_moe.py
    # and tests/unit/run/test_fsdp2.py)
    export OMP_NUM_THREADS=1 TORCH_COMPILE_OVERRIDE_BACKENDS=">=0:aot_eager"
    DEVICE=cpu PEAK=1 DEADLINE=${DEADLINE:-1800} RUNS=$OUT/runs
    BENCH_SIZE=(model.n_layer=2 model.d_model=64 model.n_head=2 model.max_seq_len=64 model.vocab_size=512)
    BENCH=(--batch 2 --repeats 1 --steps 1 --eval-steps 1 --warmup 1 --mm-size 256 --threads 1)
    TRAIN_SIZE=(model.n_layer=1 model.d_model=32 model.n_head=2 model.max_seq_len=32 data.batch_size=2
                trainer.accelerator=cpu trainer.max_steps=4 trainer.val_check_interval=4 trainer.log_every_n_steps=1
                +trainer.limit_val_batches=2 perf.peak_flops=1e11)
    ATTENTION=(--device cpu --lengths 64 --window 16 --steps 1)
    MOE=(--device cpu --experts 4 --set model.n_layer=1 model.d_model=32 model.n_head=2 model.max_seq_len=32
         --batch 2 --steps 1 --repeats 1)
    LOOP=(--loop-steps 2 --loop-repeats 1)
    MIXERS=(--device cpu --lengths 64 --steps 1)
    FP8=(precision.fp8=[mlp,attn_qkv,attn_proj] precision.fp8_min_features=32)
else
    DEVICE=cuda DEADLINE=${DEADLINE:-720}
    BENCH_SIZE=(model.n_layer=12 model.d_model=768 model.n_head=12 model.max_seq_len=1024 model.vocab_size=50304)
    BENCH=(--batch 32 --repeats 5 --block-s 0.5)
    TRAIN_SIZE=(data.batch_size=32 trainer.max_steps=150 trainer.val_check_interval=1000 trainer.log_every_n_steps=10
                perf.peak_flops=${PEAK}e12)
    ATTENTION=(--device cuda --lengths 4096 16384 --window 256 --steps 5)
    MOE=(--device cuda --experts 8 --set model.n_layer=12 model.d_model=768 model.n_head=12 model.max_seq_len=1024
         --batch 8 --steps 3 --repeats 3)
    LOOP=(--loop-repeats 3)
    MIXERS=(--device cuda --lengths 2048 8192 32768 --steps 3)
    FP8=(precision.fp8=[mlp,attn_qkv,attn_proj] precision.fp8_min_features=768)
fi
# the train.py runs: GPT-2 124M on the default corpus through its 50k BPE, as the README's scale-out section runs it
# (logger=csv: a GPU machine lent offline has no wandb, and its dependencies cannot be installed there)
TRAIN=(model=gpt2_124m data=bpe50k logger=csv "${TRAIN_SIZE[@]}")

log() { echo "$*" | tee -a "$OUT/log.txt"; }
left() { echo $(( DEADLINE - SECONDS )); }
clamp() { local limit=$1; (( limit > $(left) )) && limit=$(left); echo "$limit"; }  # a stage's limit, within DEADLINE
want() { [[ " $STAGES " == *" $1 "* ]]; }

run_stage() {  # run_stage NAME SECONDS COMMAND...: the command under a time limit, its output to the log
    local name=$1 limit rc
    limit=$(clamp "$2")
    shift 2
    if (( limit < 10 )); then log "=== $name skipped: DEADLINE (${DEADLINE}s) reached"; FAILED+=("$name"); return; fi
    log "=== $name ($(date +%T), limit ${limit}s)"
    timeout "$limit" "$@" 2>&1 | grep --line-buffered -v "━" | tee -a "$OUT/log.txt"
    rc=${PIPESTATUS[0]}
    (( rc != 0 )) && { log "=== $name failed (exit $rc)"; FAILED+=("$name"); }
}

bench() {  # bench NAME SECONDS ARGS...: python -m lmlab.bench (lmlab vs HF), its JSON to NAME.json
    local name=$1 limit=$2
    shift 2
    run_stage "$name" "$limit" $PY -m lmlab.bench --device "$DEVICE" --precision bf16 --peak-tflops "$PEAK" \
        --json "$OUT/$name.json" "$@"
}

train() {  # train NAME SECONDS OVERRIDES...: train.py through python -m lmlab.bench train, its JSON to train-NAME.json
    local name=$1 limit
    limit=$(clamp "$2")
    shift 2  # train.py is stopped 15 s before the stage, so that its figures so far are still written
    run_stage "train-$name" "$limit" $PY -m lmlab.bench train --name "$name" --runs "$RUNS" \
        --limit $(( limit > 30 ? limit - 15 : limit )) --json "$OUT/train-$name.json" -- "$@"
}

log "=== bench_gpu.sh $(date -u +%FT%TZ) stages: $STAGES$( (( DRY )) && echo ' (dry run: CPU, tiny sizes)')"
want env && run_stage env 60 $PY -m lmlab.bench env --json "$OUT/env.json" $( (( DRY )) && echo --dry-run)
# --set last: more overrides may follow (model.chunked_loss=true), then flags (--compile)
GPT2=(--config gpt2 "${BENCH[@]}" --no-fp32-baseline --loop-repeats 0 --set "${BENCH_SIZE[@]}")
want eager && bench gpt2-124m-eager 150 "${GPT2[@]}"
want compiled && bench gpt2-124m-compiled 240 "${GPT2[@]}" --compile
want train-eager && train eager 150 trainer=gpu "${TRAIN[@]}"
want train-compiled && train compiled 210 trainer=gpu "${TRAIN[@]}" compile=true
want fsdp2 && train fsdp2 210 trainer=fsdp2 trainer.devices=1 "${TRAIN[@]}" compile=true
want attention && run_stage attention 240 $PY -m lmlab.bench attention "${ATTENTION[@]}" --json "$OUT/attention.json"
want moe && run_stage moe 150 $PY -m lmlab.bench moe --precision bf16 "${MOE[@]}" --json "$OUT/moe.json"
want mixers && run_stage mixers 240 $PY -m lmlab.bench mixer "${MIXERS[@]}" --kinds attention gdn \
    --backends auto torch --no-generation --json "$OUT/mixers.json"
want fp8 && train fp8 210 trainer=gpu "${TRAIN[@]}" compile=true "${FP8[@]}"
# optional stages
want chunked && bench gpt2-124m-chunked 150 "${GPT2[@]}" model.chunked_loss=true
want chunked-compiled && bench gpt2-124m-chunked-compiled 240 "${GPT2[@]}" model.chunked_loss=true --compile
want loop && bench gpt2-124m-loop 150 --config gpt2 "${BENCH[@]}" --no-fp32-baseline --no-breakdown "${LOOP[@]}" \
    --set "${BENCH_SIZE[@]}"
LLAMA=(--config llama "${BENCH[@]}" --no-fp32-baseline --loop-repeats 0 --set "${BENCH_SIZE[@]}")
want llama && bench llama-124m-eager 150 "${LLAMA[@]}"
want llama-compiled && bench llama-124m-compiled 240 "${LLAMA[@]}" --compile

log "=== summary ($(date +%T))"
$PY -m lmlab.bench summary "$OUT" 2>&1 | tee -a "$OUT/log.txt"
(( PIPESTATUS[0] != 0 )) && FAILED+=(summary)
if (( ${#FAILED[@]} )); then log "=== failed: ${FAILED[*]}"; exit 1; fi
log "=== done in ${SECONDS}s"
