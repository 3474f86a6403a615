#!/usr/bin/env bash
# The GPU check of the performance issue, as one script: lmlab vs HF GPT2LMHeadModel at GPT-2 124M
# (12 layers x d 768 x 12 heads, seq 1024, vocab 50304), bf16 autocast, batch 32 x 1024 tokens, MFU against
# the card's bf16 dense peak (PEAK, default 989 TFLOP/s: H100/H200 SXM) and against a bf16 matmul measured
# in the same run. Stages, each under its own time limit; what they print goes to $OUT/log.txt, each result to
# $OUT/<stage>.json:
#   smoke     2 layers, batch 2, every bench path once (a broken path costs seconds, not the budget)
#   eager     lmlab, HF and lmlab fp32, 7 interleaved repeats, plus the Lightning loop's cost
#   train     train.py as a user runs it: trainer=gpu (bf16-mixed), then trainer=fsdp on one device
#   compiled  torch.compile on both models (compile time reported as warmup_s)
#   chunked, chunked-compiled   eager / compiled again with model.chunked_loss=true (the LM head and the loss in
#             row blocks: no fp32 logits of 32 x 1024 x 50304 = 6.6 GB); the A/B is each run's ratio to HF
#   loop      the Lightning loop's cost over the bare step, with and without the stability monitor
#   llama, llama-compiled   the llama-like model vs LlamaForCausalLM at the same sizes
#   scale     train.py model=gpt2_124m data=bpe50k, bf16, compiled, with trainer=gpu and then trainer=fsdp2 on one
#             GPU; tokens/s and MFU against PEAK from the runs' perf/ metrics (the scale-out issue's check)
#   attention one attention layer at T = 1024, 4096 and 16384: full causal (SDPA), a window of 256 and document masks
#             (FlexAttention, compiled), MLA: tokens/s and peak memory (python -m lmlab.bench attention --device cuda)
# STAGES picks them (default "smoke eager chunked train"); DEADLINE=<seconds> caps the whole script.
# Usage, from the repository root on a machine with CUDA (offline: the corpus already in $LMLAB_CACHE):
#   OUT=bench-gpu bash scripts/bench_gpu.sh
#   STAGES="smoke compiled chunked-compiled" OUT=bench-gpu bash scripts/bench_gpu.sh
#   STAGES="smoke loop llama llama-compiled" OUT=bench-gpu bash scripts/bench_gpu.sh
set -u
OUT=${OUT:-bench-gpu}
PEAK=${PEAK:-989}
PY=${PY:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=".:${PYTHONPATH:-}" TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/inductor}
GPT2_124M=(model.n_layer=12 model.d_model=768 model.n_head=12 model.max_seq_len=1024 model.vocab_size=50304)

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv | tee -a "$OUT/log.txt"
$PY -c "import torch, transformers, lightning; print('torch', torch.__version__, '| transformers',
transformers.__version__, '| lightning', lightning.__version__, '|', torch.cuda.get_device_name())" \
    2>&1 | tee -a "$OUT/log.txt"

left() { echo $(( ${DEADLINE:-100000} - SECONDS )); }

stage() {  # stage NAME SECONDS ARGS...: one bench run; its table to the log, its JSON to NAME.json
    local name=$1 limit=$2
    shift 2
    (( limit > $(left) )) && limit=$(left)
    (( limit < 10 )) && { echo "=== bench $name skipped: DEADLINE reached" | tee -a "$OUT/log.txt"; return 124; }
    echo "=== bench $name ($(date +%T), limit ${limit}s)" | tee -a "$OUT/log.txt"
    timeout "$limit" $PY -m lmlab.bench --config gpt2 --device "${DEVICE:-cuda}" --precision bf16 --peak-tflops "$PEAK" \
        --json "$JSON_DIR/$name.json" "$@" 2>&1 | tee -a "$OUT/log.txt"
    return "${PIPESTATUS[0]}"
}

train_check() {  # train_check NAME SECONDS OVERRIDES...: train.py as a user runs it; its summary.json back
    local name=$1 limit=$2 dir=/tmp/lmlab-gpu-runs/$1
    shift 2
    echo "=== train.py $name ($(date +%T))" | tee -a "$OUT/log.txt"
    timeout "$limit" $PY train.py logger=csv hydra.run.dir="$dir" "$@" 2>&1 | grep -v "━" | tail -n 20 \
        | tee -a "$OUT/log.txt"
    cp "$dir/summary.json" "$OUT/train-$name.json" 2>/dev/null
    tail -n 2 "$dir/metrics.csv" 2>/dev/null | tee -a "$OUT/log.txt"
}

want() { [[ " ${STAGES:-smoke eager chunked train} " == *" $1 "* ]]; }
GPT2_LOOP=(--batch 32 --repeats 3 --no-fp32-baseline --no-memory --loop-repeats 3)
QUIET=(monitor.every_n_steps=0 monitor.attn_every_n_steps=0 monitor.init_profile=false)

want smoke && { JSON_DIR=/tmp stage smoke 150 --batch 2 --set model.n_layer=2 model.d_model=128 model.n_head=2 \
    --repeats 1 --block-s 0.2 --loop-steps 3 --loop-repeats 1 || exit 1; }
JSON_DIR=$OUT
want eager && stage gpt2-124m-eager 200 --batch 32 --set "${GPT2_124M[@]}" --repeats 7 --block-s 0.5 --loop-repeats 1
want chunked && stage gpt2-124m-chunked 150 --batch 32 --set "${GPT2_124M[@]}" model.chunked_loss=true \
    --repeats 7 --block-s 0.5 --loop-repeats 0 --no-fp32-baseline
want train && train_check gpu 90 trainer=gpu trainer.max_steps=300
want train && train_check fsdp 90 trainer=fsdp trainer.devices=1 trainer.max_steps=100
want compiled && stage gpt2-124m-compiled 330 --batch 32 --set "${GPT2_124M[@]}" --repeats 7 --block-s 0.5 \
    --loop-repeats 0 --compile --no-fp32-baseline
want chunked-compiled && stage gpt2-124m-chunked-compiled 330 --batch 32 --set "${GPT2_124M[@]}" \
    model.chunked_loss=true --repeats 7 --block-s 0.5 --loop-repeats 0 --compile --no-fp32-baseline
want loop && stage gpt2-124m-loop 120 --set "${GPT2_124M[@]}" "${GPT2_LOOP[@]}"
want loop && stage gpt2-124m-loop-nomonitor 120 --set "${GPT2_124M[@]}" "${QUIET[@]}" "${GPT2_LOOP[@]}"
SCALE=(model=gpt2_124m data=bpe50k data.batch_size=16 compile=true trainer.max_steps=200 trainer.val_check_interval=1000
       perf.peak_flops=${PEAK}e12)
want scale && train_check gpt2-124m-gpu 420 trainer=gpu "${SCALE[@]}"
want scale && train_check gpt2-124m-fsdp2 420 trainer=fsdp2 trainer.devices=1 "${SCALE[@]}"
want scale && for run in gpt2-124m-gpu gpt2-124m-fsdp2; do $PY - "$run" <<'PYEOF' 2>&1 | tee -a "$OUT/log.txt"; done
import csv, sys
rows = list(csv.DictReader(open(f"/tmp/lmlab-gpu-runs/{sys.argv[1]}/metrics.csv")))
keep = [r for r in rows if r.get("perf/tokens_per_s")][-5:]
for key in ("perf/tokens_per_s", "perf/mfu"):
    vals = [float(r[key]) for r in keep if r.get(key)]
    print(sys.argv[1], key, "last 5 logged:", [round(v, 4) for v in vals])
PYEOF
want llama && stage llama-124m-eager 150 --config llama --batch 32 --set "${GPT2_124M[@]}" --repeats 7 \
    --block-s 0.5 --loop-repeats 0 --no-fp32-baseline
want llama-compiled && stage llama-124m-compiled 300 --config llama --batch 32 --set "${GPT2_124M[@]}" \
    --repeats 5 --block-s 0.5 --loop-repeats 0 --no-fp32-baseline --compile
want attention && { echo "=== bench attention ($(date +%T))" | tee -a "$OUT/log.txt"
    timeout 300 $PY -m lmlab.bench attention --device cuda --lengths 1024 4096 16384 --window 256 --steps 5 \
        --json "$OUT/attention.json" 2>&1 | tee -a "$OUT/log.txt"; }
