#!/usr/bin/env bash
# One call on the GPU machine for what the CPU cannot check: the GPU tests, then the benchmarks whose figures the docs
# quote. Run from the repository root (the `run` tool's working directory); results go to $OUT (or ./gpu-out).
#
#   bash benchmarks/gpu_session.sh [PART]...   (default: tests monitor microbatch)
#   PART: tests, monitor, microbatch, microbatch-gpt, microbatch-gpt-profile, profile, profile-trace, snapshot, tuner, tuner-gpt, tuner-resnet,
#         tuner-resnet-12, tuner-longval, plan, plan-expandable, tuner-predict, tuner-predict-12, tuner-42a, tuner-42b,
#         tuner-42c, tuner-42-all, truth, token-budget, fidelity, fidelity-fit, ddp2
#
# plan: MemoryPlanner's predictions against measured peaks on six workloads (benchmarks/plan.py) -> plan.json, .log;
# plan-expandable: the same for the two GPTs with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True; tuner-predict:
# BatchSizeTuner (predict, then validate; headroom 0 and 0.05) against BatchSizeFinder(mode="binsearch") and the
# true maximum (a 4-step fit + 1 validation batch in a fresh process) at 24 GiB on gpt, gpt124, vit and resnet
# (TUNER_MODELS overrides) -> tuner-predict-24gib.json; tuner-predict-12: gpt, gpt-ckpt, encoder at 12 GiB.
#
# tuner-42a, tuner-42b, tuner-42c: BatchSizeTuner's default search (finder "default": no `method` passed) against the
# previous version of the package (previous-predict, previous-search: method="predict"/"search", imported from
# out/previous/lightning_gpumem, which the caller must carry to the device) and BatchSizeFinder(mode="binsearch"), at
# 24 GiB, headroom 0.02, a 4-step fit + 1 validation batch after each search, and the true maximum (the same fit at a
# fixed size, up to 5 at once: 3 on an 80 GB card; its first round centred on "default"'s answer). Five workloads in
# three parts of about 6-8 minutes each on an H100 (TUNER_MODELS overrides a part's list): tuner-42a: gpt, hf-gpt2
# (transformers' GPT2LMHeadModel, GPT-2 medium config, random init); tuner-42b: resnet; tuner-42c: gpt-longval, vit
# -> tuner-42a.json, .log and so on. TUNER_S (default 540) bounds each part; --time-limit is 30 s under it.
#
# tuner-42-all: the five workloads of tuner-42a/b/c in one part, without the true-maximum search (the true maxima
# are the model's and the cap's, measured by the three parts) and without previous-predict: the default, the
# previous method="search" and binsearch (TUNER42_FINDERS overrides), about 8-9 minutes on an H100 -> tuner-42-all.json, .log.
#
# fidelity-fit: the allocator histories of benchmarks/tuner.py's true-max fit (Lightning, shuffled batches,
# FIDELITY_FIT_STEPS steps and a validation batch) at FIDELITY_FIT sizes of FIDELITY_FIT_WORKLOAD under 24 GiB
# (FIDELITY_FIT_PLAIN=" " for the plain loop instead) -> fidelity-fit.tgz, .log; read with trace_vs_history.py.
#
# fidelity: real allocator histories (benchmarks/allocator_fidelity.py: FIDELITY_MODELS, FIDELITY_MODES; the 236M
# GPT at FIDELITY_GPT under 24 GiB, with 4096-token validation at FIDELITY_LONGVAL, HF GPT-2 at FIDELITY_HF)
# -> fidelity.tgz (the streams; replay them anywhere with --check), fidelity.log.
#
# truth: the true maximum alone (no finder) under TRUTH_GIB (default 48) on TRUTH_MODELS, its first candidate
# TRUTH_GUESS (model=size pairs, e.g. the traced plan's sizes); up to TRUTH_PARALLEL at once, as many as fit the card
# (one under 48 GiB on an 80 GB card: it gallops out from the guess, then bisects); TRUTH_STEPS training steps (4) -> truth-<GIB>gib-<TRUTH_NAME>.json.
#
# token-budget: TokenBudgetSampler with a tuned max_tokens against BatchSizeFinder, the worst-case batch size and a
# hand-set budget, one epoch each (benchmarks/token_budget.py; TOKEN_ATTENTION, TOKEN_DATASETS, TOKEN_CONFIGS,
# TOKEN_SAMPLES, TOKEN_S; TOKEN_EXPANDABLE=1: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True; TOKEN_SHAPE_MARGIN:
# the tuner's shape_margin) -> token-budget-<attention>[-expandable][-margin<m>].json, .log.
#
# snapshot: ways of copying the weights to host memory, timed (benchmarks/snapshot_cost.py on SNAPSHOT_MODELS)
# -> snapshot-cost.json, .log.
#
# profile-trace: benchmarks/profile_tuner.py --finder trace on each of PROFILE_MODELS ("gpt hf-gpt2" by default), one
# process each, at 24 GiB, headroom 0.02 -> profile-trace.log (start="trace"'s stages).
#
# microbatch-gpt: AutoMicrobatch (never splitting) and MemoryMonitor against no callback on a 253.5M-parameter GPT,
# 7 interleaved rounds (about 2 min) -> microbatch-gpt-overhead.json, .log; microbatch-gpt-profile: torch.profiler
# and cProfile tables of a few steps of the same fits -> microbatch-gpt-profile.log.
#
# Each part writes its log and JSON under $OUT; a failing part does not stop the others; the exit status is the
# number of failed parts. Each part has a time limit (seconds, from TESTS_S, MONITOR_S, MICROBATCH_S,
# MICROBATCH_GPT_S, MICROBATCH_GPT_PROFILE_S, PROFILE_S, TUNER_S, TUNER_GPT_S, TUNER_RESNET_S, TUNER_LONGVAL_S) so
# that one hang cannot use up a 600 s call.
set -u
OUT=${OUT:-gpu-out}
mkdir -p "$OUT"
export PYTHONPATH=.
failed=0
parts=("$@")
declare -A TUNER42_MODELS=([tuner-42a]=gpt,hf-gpt2 [tuner-42b]=resnet [tuner-42c]=gpt-longval,vit)
TUNER42_ARGS=(--budget-gib 24 --headroom 0.02 --fit-steps 4 --fit-val-batches 1 --true-max fit --parallel 5
  --rotate --finders default,previous-predict,previous-search,binsearch --previous out/previous)
[ ${#parts[@]} -eq 0 ] && parts=(tests monitor microbatch)
for part in "${parts[@]}"; do
  start=$(date +%s)
  case "$part" in
    tests) timeout ${TESTS_S:-330} python3 -m pytest -m gpu tests -q -rA -p no:cacheprovider > "$OUT/gpu-tests.log" 2>&1 ;;
    monitor) timeout ${MONITOR_S:-200} python3 benchmarks/monitor_overhead.py --rounds 5 --steps 200 --json "$OUT/monitor-overhead.json" \
      > "$OUT/monitor-overhead.log" 2>&1 ;;
    microbatch) timeout ${MICROBATCH_S:-200} python3 benchmarks/microbatch_overhead.py --rounds 7 --json "$OUT/microbatch-overhead.json" \
      > "$OUT/microbatch-overhead.log" 2>&1 ;;
    microbatch-gpt) timeout ${MICROBATCH_GPT_S:-240} python3 benchmarks/microbatch_gpt_overhead.py --rounds 7 \
      --json "$OUT/microbatch-gpt-overhead.json" > "$OUT/microbatch-gpt-overhead.log" 2>&1 ;;
    microbatch-gpt-profile) timeout ${MICROBATCH_GPT_PROFILE_S:-150} python3 benchmarks/microbatch_gpt_overhead.py \
      --profile > "$OUT/microbatch-gpt-profile.log" 2>&1 ;;
    profile-trace) for model in ${PROFILE_MODELS:-gpt hf-gpt2}; do  # start="trace"'s stages, one process each
        HF_HUB_OFFLINE=1 timeout ${PROFILE_S:-120} python3 benchmarks/profile_tuner.py --finder trace --model "$model" \
        --budget-gib 24 --headroom 0.02 >> "$OUT/profile-trace.log" 2>&1; done ;;
    snapshot) HF_HUB_OFFLINE=1 timeout ${SNAPSHOT_S:-120} python3 benchmarks/snapshot_cost.py --models ${SNAPSHOT_MODELS:-gpt,hf-gpt2} \
      --json "$OUT/snapshot-cost.json" > "$OUT/snapshot-cost.log" 2>&1 ;;
    profile) timeout ${PROFILE_S:-120} python3 benchmarks/profile_monitor.py --default-only > "$OUT/profile-monitor.log" 2>&1 ;;
    tuner) timeout ${TUNER_S:-280} python3 benchmarks/tuner.py --models gpt,gpt-longval --budget-gib 24 --finders ours,binsearch \
      --headroom 0.05,0.02 --time-limit 265 --json "$OUT/tuner-24gib.json" > "$OUT/tuner-24gib.log" 2>&1;
      timeout ${TUNER_S:-280} python3 benchmarks/tuner.py --models gpt,gpt-longval --budget-gib 12 --parallel 10 \
      --finders ours,binsearch --headroom 0.05,0.02 --time-limit 235 --json "$OUT/tuner-12gib.json" > "$OUT/tuner-12gib.log" 2>&1 ;;
    tuner-gpt) timeout ${TUNER_GPT_S:-200} python3 benchmarks/tuner.py --models gpt --budget-gib 24 --finders ours,binsearch \
      --headroom 0.05,0.02 --time-limit 165 --json "$OUT/tuner-24gib-gpt.json" > "$OUT/tuner-24gib-gpt.log" 2>&1 ;;
    tuner-resnet) timeout ${TUNER_RESNET_S:-330} python3 benchmarks/tuner.py --models resnet --budget-gib 24 \
      --finders ours,binsearch --headroom 0.05,0.02 --time-limit 260 --json "$OUT/tuner-24gib-resnet.json" \
      > "$OUT/tuner-24gib-resnet.log" 2>&1 ;;
    tuner-resnet-12) timeout ${TUNER_RESNET_S:-330} python3 benchmarks/tuner.py --models resnet --budget-gib 12 --parallel 10 \
      --finders ours,binsearch --headroom 0.05,0.02 --time-limit 260 --json "$OUT/tuner-12gib-resnet.json" \
      > "$OUT/tuner-12gib-resnet.log" 2>&1 ;;
    tuner-longval) timeout ${TUNER_LONGVAL_S:-240} python3 benchmarks/tuner.py --models gpt-longval --budget-gib 24 \
      --finders ours,binsearch --headroom 0.05,0.02 --time-limit 200 --json "$OUT/tuner-24gib-longval.json" \
      > "$OUT/tuner-24gib-longval.log" 2>&1;
      timeout ${TUNER_LONGVAL_S:-240} python3 benchmarks/tuner.py --models gpt-longval --budget-gib 12 --parallel 10 \
      --finders ours,binsearch --headroom 0.05,0.02 --time-limit 200 --json "$OUT/tuner-12gib-longval.json" \
      > "$OUT/tuner-12gib-longval.log" 2>&1 ;;
    tuner-order) HF_HUB_OFFLINE=1 timeout ${TUNER_S:-300} python3 benchmarks/tuner.py --models ${TUNER_MODELS:-gpt-longval,hf-gpt2} \
      --budget-gib 24 --headroom 0.02 --fit-steps 4 --fit-val-batches 1 --true-max none \
      --finders previous-search,default --previous out/previous --time-limit $(( ${TUNER_S:-300} - 20 )) \
      --json "$OUT/tuner-order.json" > "$OUT/tuner-order.log" 2>&1 ;;  # the previous search first: order effects
    plan) timeout ${PLAN_S:-330} python3 benchmarks/plan.py --models ${PLAN_MODELS:-gpt124,gpt,resnet,vit,encoder,gpt-ckpt} \
      --json "$OUT/plan.json" > "$OUT/plan.log" 2>&1 ;;
    plan-expandable) timeout ${PLAN_S:-200} python3 benchmarks/plan.py --models gpt124,gpt --expandable \
      --json "$OUT/plan-expandable.json" > "$OUT/plan-expandable.log" 2>&1 ;;
    tuner-predict) timeout ${TUNER_S:-560} python3 benchmarks/tuner.py --models ${TUNER_MODELS:-gpt,gpt124,vit,resnet} \
      --budget-gib 24 --finders predict,binsearch --headroom 0.0,0.05 --fit-steps 4 --fit-val-batches 1 \
      --time-limit $(( ${TUNER_S:-560} - 40 )) --json "$OUT/tuner-predict-24gib.json" > "$OUT/tuner-predict-24gib.log" 2>&1 ;;
    tuner-predict-12) timeout ${TUNER_S:-400} python3 benchmarks/tuner.py --models ${TUNER_MODELS:-gpt,gpt-ckpt,encoder} \
      --budget-gib 12 --parallel 10 --finders predict,binsearch --headroom 0.0 --fit-steps 4 --fit-val-batches 1 \
      --time-limit $(( ${TUNER_S:-400} - 40 )) --json "$OUT/tuner-predict-12gib.json" > "$OUT/tuner-predict-12gib.log" 2>&1 ;;
    tuner-42a|tuner-42b|tuner-42c) HF_HUB_OFFLINE=1 timeout ${TUNER_S:-540} python3 benchmarks/tuner.py \
      --models ${TUNER_MODELS:-${TUNER42_MODELS[$part]}} "${TUNER42_ARGS[@]}" --time-limit $(( ${TUNER_S:-540} - 30 )) \
      --json "$OUT/$part.json" > "$OUT/$part.log" 2>&1 ;;
    tuner-42-all) HF_HUB_OFFLINE=1 timeout ${TUNER_S:-560} python3 benchmarks/tuner.py \
      --models ${TUNER_MODELS:-gpt,hf-gpt2,resnet,gpt-longval,vit} --budget-gib 24 --headroom 0.02 --fit-steps 4 \
      --fit-val-batches 1 --true-max none --rotate --finders ${TUNER42_FINDERS:-default,previous-search,binsearch} \
      --previous out/previous --time-limit $(( ${TUNER_S:-560} - 60 )) --json "$OUT/$part.json" > "$OUT/$part.log" 2>&1 ;;
    truth) HF_HUB_OFFLINE=1 timeout ${TRUTH_S:-330} python3 benchmarks/tuner.py --models ${TRUTH_MODELS:-gpt} \
      --budget-gib ${TRUTH_GIB:-48} --finders "" --guess "${TRUTH_GUESS:-}" --parallel ${TRUTH_PARALLEL:-5} \
      --fit-steps ${TRUTH_STEPS:-4} --fit-val-batches 1 --true-max fit --time-limit $(( ${TRUTH_S:-330} - 40 )) \
      --json "$OUT/truth-${TRUTH_GIB:-48}gib-${TRUTH_NAME:-a}.json" > "$OUT/truth-${TRUTH_GIB:-48}gib-${TRUTH_NAME:-a}.log" 2>&1 ;;
    token-budget) name=token-budget-${TOKEN_ATTENTION:-sdpa}${TOKEN_EXPANDABLE:+-expandable}${TOKEN_SHAPE_MARGIN:+-margin$TOKEN_SHAPE_MARGIN}
      timeout ${TOKEN_S:-420} python3 benchmarks/token_budget.py --attention ${TOKEN_ATTENTION:-sdpa} \
      --datasets ${TOKEN_DATASETS:-zipf,skewed} --configs ${TOKEN_CONFIGS:-worst,tuned,hand,finder} \
      --samples ${TOKEN_SAMPLES:-3000} --time-limit $(( ${TOKEN_S:-420} - 20 )) ${TOKEN_EXPANDABLE:+--expandable} \
      ${TOKEN_SHAPE_MARGIN:+--shape-margin $TOKEN_SHAPE_MARGIN} \
      --json "$OUT/$name.json" > "$OUT/$name.log" 2>&1 ;;
    fidelity) PYTHONPATH=. timeout ${FIDELITY_S:-150} python3 benchmarks/allocator_fidelity.py --out /tmp/gpumem-fidelity \
      --models ${FIDELITY_MODELS:-lm,lm-bf16,transformer,mlp} --modes ${FIDELITY_MODES:-native} > "$OUT/fidelity.log" 2>&1;
      PYTHONPATH=. timeout ${FIDELITY_GPT_S:-90} python3 benchmarks/allocator_fidelity.py --out /tmp/gpumem-fidelity-gpt \
      --gpt ${FIDELITY_GPT:-8,38,41} >> "$OUT/fidelity.log" 2>&1;
      PYTHONPATH=. timeout ${FIDELITY_LONGVAL_S:-60} python3 benchmarks/allocator_fidelity.py --out /tmp/gpumem-fidelity-gpt \
      --gpt ${FIDELITY_LONGVAL:-19} --gpt-workload gpt-longval >> "$OUT/fidelity.log" 2>&1;
      HF_HUB_OFFLINE=1 PYTHONPATH=. timeout ${FIDELITY_HF_S:-60} python3 benchmarks/allocator_fidelity.py \
      --out /tmp/gpumem-fidelity-gpt --gpt ${FIDELITY_HF:-13} --gpt-workload hf-gpt2 >> "$OUT/fidelity.log" 2>&1;
      tar czf "$OUT/fidelity.tgz" -C /tmp gpumem-fidelity gpumem-fidelity-gpt ;;  # one file: the streams, for --check
    fidelity-fit) PYTHONPATH=. timeout ${FIDELITY_FIT_S:-240} python3 benchmarks/allocator_fidelity.py \
      --out /tmp/gpumem-fidelity-fit --gpt ${FIDELITY_FIT:-78,79,80} --gpt-workload ${FIDELITY_FIT_WORKLOAD:-gpt-ckpt} \
      --steps ${FIDELITY_FIT_STEPS:-4} ${FIDELITY_FIT_PLAIN:---lightning} > "$OUT/fidelity-fit.log" 2>&1;
      tar czf "$OUT/fidelity-fit.tgz" -C /tmp gpumem-fidelity-fit ;;  # the fit's own streams (issue 43's gpt-ckpt)
    ddp2) timeout ${DDP2_S:-560} python3 benchmarks/ddp2.py --time-limit $(( ${DDP2_S:-560} - 20 )) \
      --json "$OUT/ddp2.json" > "$OUT/ddp2.log" 2>&1 ;;  # two GPUs (issue 30); --cpu: the gloo dry run
    *) echo "unknown part: $part" >&2; false ;;
  esac
  status=$?
  echo "$part: exit $status in $(( $(date +%s) - start )) s" | tee -a "$OUT/summary.txt"
  [ $status -ne 0 ] && failed=$((failed + 1))
done
tail -n 3 "$OUT/gpu-tests.log" 2>/dev/null
exit $failed
