#!/usr/bin/env bash
# repro/gpu_bench.py on a lent GPU machine (issue 41), in two halves:
#
#   bash repro/gpu_bench.sh pack        # here, once: .whl/ (wheels), .gpu_data/ (data subset + tokenizer)
#   bash repro/gpu_bench.sh run [SHAPE] [DEADLINE_S] [-- extra gpu_bench.py flags]   # there, from the repository root
#
# The GPU machine has python3.12 with torch, transformers, accelerate, numpy, pandas, pyarrow...
# but not lm-eval, datasets and their pure-Python needs: `pack` downloads those as Python 3.12
# wheels (the versions installed here, which the project is tested with) into .whl/, copies the
# benchmark files gpu_bench.py reads from $MARI_DATA_DIR and the embedded SmolLM2 tokenizer into
# .gpu_data/, and says their sizes. Both folders are ignored by git (.git/info/exclude) and travel
# as the device call's `carry` paths. `run` installs the wheels into /tmp/site, then runs the
# benchmark at SHAPE (default llama2_7b) writing $OUT/gpu_bench_raw.json (else runs/), with
# DEADLINE_S seconds of measurement (default 400).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

# Not on the GPU machine's image (the device notes' package list): lm-eval 0.4.13 and what it,
# datasets and our harness tasks import. Pure-Python wheels except multiprocess (one per Python).
WHEELS="lm_eval==0.4.13 datasets==5.2.0 evaluate==0.4.6 dill==0.4.1 multiprocess==0.70.19 pytablewriter==1.2.1
DataProperty==1.1.1 mbstrdecoder==1.1.5 pathvalidate==3.3.1 tabledata==1.3.5 tcolorpy==0.1.7 typepy==1.3.5
chardet==6.0.0.post1 more-itertools==11.2.1 nltk==3.10.4 defusedxml==0.7.1 pytz==2026.6 platformdirs==4.14.8"
# Published as source only: built into wheels here.
SDISTS="sqlitedict==2.1.0 word2number==1.1 rouge_score==0.1.2"
# What gpu_bench.py reads under $MARI_DATA_DIR: TruthfulQA (training and truthfulqa_mc2), BBQ, SORRY-Bench,
# MMLU (5-shot subjects and MARI's MMLU controls) and ARC-Easy (MARI's ARC controls, arc_easy_first25's splits).
DATA_FILES="truthfulqa/mc.jsonl.gz sorry_bench/question.jsonl.gz sorry_bench/categories.json
mmlu/dev.jsonl.gz mmlu/validation.jsonl.gz mmlu/test.jsonl.gz
arc/ARC-Easy-train.jsonl.gz arc/ARC-Easy-validation.jsonl.gz arc/ARC-Easy-test.jsonl.gz
bbq/Age.jsonl.gz bbq/Disability_status.jsonl.gz bbq/Gender_identity.jsonl.gz bbq/Nationality.jsonl.gz
bbq/Physical_appearance.jsonl.gz bbq/Religion.jsonl.gz bbq/Sexual_orientation.jsonl.gz"

pack() {
  local data="${MARI_DATA_DIR:-$ROOT/../shared/data}"
  mkdir -p .git/info && touch .git/info/exclude
  for path in /.whl/ /.gpu_data/; do grep -qxF "$path" .git/info/exclude || echo "$path" >> .git/info/exclude; done
  rm -rf .whl .gpu_data && mkdir -p .whl .gpu_data/data
  # shellcheck disable=SC2086
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl $WHEELS
  # shellcheck disable=SC2086
  python3 -m pip wheel -q --no-deps -w .whl $SDISTS
  for file in $DATA_FILES; do
    mkdir -p ".gpu_data/data/$(dirname "$file")" && cp "$data/$file" ".gpu_data/data/$file"
  done
  HF_HUB_OFFLINE=1 python3 -c "from repro.benchmark.random_model import tokenizer_folder; tokenizer_folder('.gpu_data/tokenizer')"
  du -sh .whl .gpu_data .gpu_data/data .gpu_data/tokenizer
}

run() {
  local shape="${1:-llama2_7b}" deadline="${2:-400}"
  shift $(( $# > 2 ? 2 : $# )); [ "${1:-}" = "--" ] && shift
  local out="${OUT:-$ROOT/runs}"
  mkdir -p "$out"
  if [ -d .whl ] && [ -z "${GPU_BENCH_SKIP_INSTALL:-}" ]; then  # GPU_BENCH_SKIP_INSTALL=1: use this Python's packages
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
  fi
  export MARI_DATA_DIR="$ROOT/.gpu_data/data" HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1 \
    TOKENIZERS_PARALLELISM=false MARI_EVAL_CACHE=/tmp/mari-eval-cache HF_DATASETS_CACHE=/tmp/hf-datasets
  python3 -c "import torch, transformers, lm_eval, datasets, pyarrow; print('versions:', torch.__version__, torch.version.cuda, \
transformers.__version__, lm_eval.__version__ if hasattr(lm_eval, '__version__') else '', datasets.__version__, pyarrow.__version__)"
  local status=0
  python3 repro/gpu_bench.py --shape "$shape" --tokenizer .gpu_data/tokenizer --raw "$out/gpu_bench_raw.json" \
    --deadline-s "$deadline" "$@" 2> >(tee "$out/gpu_bench.log" >&2) || status=$?
  # What was measured is rendered even when the run broke off (the raw file is written after every step).
  [ -f "$out/gpu_bench_raw.json" ] && python3 repro/gpu_bench.py --render "$out/gpu_bench_raw.json" --out "$out"
  return "$status"
}

case "${1:-}" in
  pack) pack ;;
  run) shift; run "$@" ;;
  *) echo "usage: bash repro/gpu_bench.sh pack | run [SHAPE] [DEADLINE_S] [-- gpu_bench.py flags]" >&2; exit 2 ;;
esac
