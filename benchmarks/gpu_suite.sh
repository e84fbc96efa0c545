#!/usr/bin/env bash
# The GPU rows of BENCHMARKS.md and RESULTS.md in one command, on one machine, so that mappo and
# JaxMARL are measured minutes apart. Each part writes its JSON (or run directories) into the
# output folder and has a time limit of its own: a part that fails or runs out of time is logged
# in log.txt and the next one runs; the script exits 1 if any part failed. Use a new OUT per call
# (the time-to-target runs of an earlier call would be reported with the new ones).
#
#   benchmarks/gpu_suite.sh OUT [PART...]      # default: every part, in the order below
#
# Parts:
#   ff       feed-forward IPPO at JaxMARL's settings (16 envs x 128 steps, 4 x 4), eager and
#            compiled (CUDA graphs where the graphs allow)
#   seeds    the same with num_seeds=10 in one process
#   env      the particle world's Spread alone at 4,096 and 65,536 envs, eager and compiled
#   paper    rMAPPO at the paper's settings (128 envs x 25 steps), eager and compiled
#   target   time to greedy -120 on Spread (mpe/simple_spread_gpu, compile=on) on $SEEDS seeds,
#            then `mappo report --target -120` over them
#   hanabi   Hanabi's env at 4,096 and 65,536 2-player games (with JaxMARL's where it imports)
#   hanabi_train
#            MAPPO on 2-player Hanabi at JaxMARL's IPPO batch (hanabi/full-2p_gpu), eager and
#            compiled, then a learning run per seed in $HANABI_SEEDS of $HANABI_SECONDS each
#            (max_wall_seconds: it ends with its 1,000-game evaluation and checkpoint), then
#            `mappo report` of their scores
#   jaxmarl  JaxMARL's own ippo_ff_mpe.py (1 seed and 10 seeds) and ippo_ff_hanabi.py, where
#            $JAXMARL_BASELINES names the baselines folder of a JaxMARL checkout and jax imports
#
# Environment: DEVICE (default cuda), SEEDS (default "1 2 3 4 5"), MAPPO (default `mappo`;
# e.g. "python -m mappo.cli" with PYTHONPATH=src from a source tree), PYTHON (default python3),
# COMPILE (the target and hanabi_train parts' compile setting, default on), EXTRA (overrides
# added to every training run, e.g. "total_env_steps=1000000"), HANABI_SEEDS (default "1"),
# HANABI_SECONDS (default 240).
set -uo pipefail
out=${1:?usage: gpu_suite.sh OUT [PART...]}
shift
parts=${*:-ff seeds env paper target hanabi hanabi_train jaxmarl}
device=${DEVICE:-cuda}
seeds=${SEEDS:-1 2 3 4 5}
mappo=${MAPPO:-mappo}
python=${PYTHON:-python3}
compile=${COMPILE:-on}
extra=${EXTRA:-}
hanabi_seeds=${HANABI_SEEDS:-1}
hanabi_seconds=${HANABI_SECONDS:-240}
here=$(cd "$(dirname "$0")" && pwd)
known=" ff seeds env paper target hanabi hanabi_train jaxmarl "
for part in $parts; do
    if [[ $known != *" $part "* ]]; then
        echo "unknown part '$part' (ff seeds env paper target hanabi hanabi_train jaxmarl)" >&2
        exit 2
    fi
done
if ! command -v timeout > /dev/null; then
    echo "the suite needs 'timeout' (GNU coreutils)" >&2
    exit 2
fi
for runs in target_runs hanabi_runs; do
    if [ -e "$out/$runs" ]; then
        echo "$out/$runs exists (an earlier call's runs); give a new OUT folder" >&2
        exit 2
    fi
done
mkdir -p "$out"
log="$out/log.txt"
failed=0

# run NAME SECONDS COMMAND...: COMMAND's stdout into NAME.json, its stderr into NAME.err
run() {
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS
    echo "$(date +%T) start $name: $*" >> "$log"
    # SIGTERM at the limit (runs save a checkpoint on it), SIGKILL 30 s later
    timeout -k 30 "$limit" "$@" > "$out/$name.json" 2> "$out/$name.err"
    local rc=$?
    if [ $rc -ne 0 ]; then failed=1; fi
    echo "$(date +%T) end $name: rc=$rc, $((SECONDS - start)) s" >> "$log"
}

ff="mpe/simple_spread_jaxmarl_ff device=$device $extra"
for part in $parts; do
    case $part in
    ff)
        run ff_eager 300 $mappo bench train $ff compile=off --iterations 20 --json
        run ff_compiled 420 $mappo bench train $ff compile=on --iterations 20 --json
        ;;
    seeds)
        run ff_10_seeds 420 $mappo bench train $ff compile=on num_seeds=10 --iterations 10 --json
        ;;
    env)
        for flag in "" --compile; do
            run "env_spread${flag:+_compiled}" 300 $mappo bench env --envs mpe/simple_spread \
                --num-envs 4096 65536 --device "$device" --no-pettingzoo --seconds 2 $flag --json
        done
        ;;
    paper)
        for mode in off on; do
            run "paper_compile_$mode" 420 $mappo bench train mpe/simple_spread device="$device" \
                compile=$mode $extra --iterations 5 --json
        done
        ;;
    target)
        for seed in $seeds; do
            run "target_seed$seed" 300 $mappo train mpe/simple_spread_gpu device="$device" \
                compile="$compile" seed="$seed" run_dir="$out/target_runs" $extra
        done
        run target_report 60 $mappo report "$out/target_runs" --target -120 --format json
        ;;
    hanabi)
        jax=""
        if $python -c "import jaxmarl" 2> /dev/null; then jax=--jaxmarl; fi
        run hanabi_env 420 $python "$here/hanabi_throughput.py" --device "$device" \
            --num-envs 4096 65536 $jax --json
        ;;
    hanabi_train)
        for mode in off on; do
            run "hanabi_train_compile_$mode" 420 $mappo bench train hanabi/full-2p_gpu \
                device="$device" compile=$mode $extra --iterations 3 --json
        done
        for seed in $hanabi_seeds; do
            # (the limit leaves room for the compile, the final evaluation and the checkpoint)
            run "hanabi_learn_seed$seed" $((hanabi_seconds + 300)) $mappo train \
                hanabi/full-2p_gpu device="$device" compile="$compile" seed="$seed" \
                max_wall_seconds="$hanabi_seconds" run_dir="$out/hanabi_runs" progress=false $extra
        done
        run hanabi_report 60 $mappo report "$out/hanabi_runs" --metric eval/eval_score \
            --format json
        ;;
    jaxmarl)
        if [ -z "${JAXMARL_BASELINES:-}" ] || ! $python -c "import jax" 2> /dev/null; then
            echo "$(date +%T) skip jaxmarl: set JAXMARL_BASELINES and install jax" >> "$log"
            continue
        fi
        script="$JAXMARL_BASELINES/IPPO/ippo_ff_mpe.py"
        run jaxmarl_ff 420 $python "$here/jaxmarl_baseline.py" "$script" --updates 400 \
            --repeats 2 --json
        run jaxmarl_ff_10_seeds 420 $python "$here/jaxmarl_baseline.py" "$script" --updates 100 \
            --repeats 1 --seeds 10 --json
        # (1,024 games x 128 steps an update: 20 updates are 2.6M env steps)
        run jaxmarl_hanabi 420 $python "$here/jaxmarl_baseline.py" \
            "$JAXMARL_BASELINES/IPPO/ippo_ff_hanabi.py" --updates 20 --repeats 1 --json
        ;;
    esac
done
echo "$(date +%T) done$([ $failed -eq 0 ] || echo ', some parts failed')" >> "$log"
exit $failed
