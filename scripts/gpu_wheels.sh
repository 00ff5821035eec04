#!/usr/bin/env bash
# Downloads, into the git-ignored .gpu_wheels/, the wheels of what groupflow and the GPU check
# (scripts/gpu_check.sh) import but the GPU machine's image lacks. That machine has no network,
# Python 3.12 on x86-64, and its own CUDA torch, transformers, accelerate, peft, safetensors,
# pyyaml, pyarrow, numpy, tqdm, matplotlib, pytest (see benchmarks/README.md, "GPU check"), so only
# small pure-Python or manylinux cp312 wheels go over, never torch. Versions are pinned to the ones
# the CPU suite runs with. Ray and vLLM are too large to carry (and vLLM brings its own torch).
#
#   bash scripts/gpu_wheels.sh            # then: run `bash scripts/gpu_check.sh`, carry .gpu_wheels
#
# Needs pip and PyPI (not a GPU). Fails if the folder grows past GPU_WHEELS_MAX_MIB (40 MiB: the
# device machine takes 64 MiB of files per call, the repository included).
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${GPU_WHEELS_DIR:-.gpu_wheels}
MAX_MIB=${GPU_WHEELS_MAX_MIB:-40}
PYTHON=${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}

# name==version, one a line. What each is for:
WHEELS=(
  # groupflow's core path: the typed config
  pydantic==2.14.4
  pydantic-core==2.50.5
  annotated-types==0.8.0
  typing-inspection==0.4.5
  typing-extensions==4.16.0  # pydantic 2.14 needs a recent one; the image's may be older
  # Wan / SD3 transformers for the diffusion part (pure Python)
  diffusers==0.42.1
  importlib-metadata==9.1.0
  # TRL's GRPOTrainer for the side-by-side step (TRL reads its prompts from a datasets.Dataset)
  trl==1.16.0
  datasets==5.2.0
  dill==0.4.1
  multiprocess==0.70.19
)

mkdir -p "$DEST"
# One version of each package: a stale wheel of another version would make the install ambiguous.
for spec in "${WHEELS[@]}"; do
  name=${spec%%==*}
  stem=$(echo "$name" | tr '-' '_')
  for old in "$DEST"/"$stem"-*.whl; do
    [ -e "$old" ] || continue
    case "$old" in
      "$DEST/$stem-${spec##*==}-"*) ;;
      *) echo "gpu_wheels: removing $old (not ${spec##*==})"; rm -f "$old" ;;
    esac
  done
done

"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any \
  -d "$DEST" "${WHEELS[@]}"

missing=()
for spec in "${WHEELS[@]}"; do
  stem=$(echo "${spec%%==*}" | tr '-' '_')
  ls "$DEST"/"$stem"-"${spec##*==}"-*.whl >/dev/null 2>&1 || missing+=("$spec")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "gpu_wheels: no wheel for: ${missing[*]}" >&2
  exit 1
fi
total=$(du -cb "$DEST"/*.whl | tail -1 | cut -f1)
echo "gpu_wheels: $(ls "$DEST"/*.whl | wc -l) wheels, $((total / 1024 / 1024)) MiB in $DEST"
ls -1 "$DEST"
if [ "$total" -gt $((MAX_MIB * 1024 * 1024)) ]; then
  echo "gpu_wheels: $DEST holds more than $MAX_MIB MiB; the device machine takes 64 MiB per call" >&2
  exit 1
fi
