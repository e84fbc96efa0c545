#!/usr/bin/env bash
# Every throughput benchmark recorded in BENCHMARKS.md, one after another (run it on an otherwise
# idle machine: a training run in the background halves the numbers on 2 cores). Writes one JSON
# file per benchmark into the folder given as the first argument (default: bench-results/).
set -euo pipefail
out=${1:-bench-results}
mkdir -p "$out"
mappo bench env --json > "$out/env_spread.json"
mappo bench env --envs smac/3m smac/8m smac/MMM --num-envs 1024 --no-pettingzoo --json \
    > "$out/env_smac.json"
for preset in mpe/simple_spread mpe/simple_spread_mappo mpe/simple_spread_fast \
              mpe/simple_spread_jaxmarl_rnn mpe/simple_spread_jaxmarl_ff smac/3m_fast; do
    for threads in 1 2; do
        mappo bench train "$preset" "threads=$threads" --iterations 5 --json \
            > "$out/train_${preset//\//_}_t${threads}.json"
    done
done
python "$(dirname "$0")/compiled.py" --rounds 2 --json > "$out/compiled.json"
python "$(dirname "$0")/seeds.py" --rounds 2 --json > "$out/seeds.json"
python "$(dirname "$0")/seeds.py" --presets mpe/simple_spread --seeds 1 4 --rounds 1 --iterations 3 --json > "$out/seeds_paper.json"
python "$(dirname "$0")/adapter_overhead.py" --json > "$out/adapter_overhead.json"
python "$(dirname "$0")/sweep_overhead.py" --steps 450000 > "$out/sweep_overhead.json"
python "$(dirname "$0")/vmas_throughput.py" --scenario navigation balance --json \
    > "$out/vmas_throughput.json"
