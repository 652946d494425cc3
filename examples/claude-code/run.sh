#!/usr/bin/env bash
# The smallest Claude Code episode: open, run Claude Code once against it, close with a reward.
# Usage: examples/claude-code/run.sh [PROXY_URL] ["prompt"]   (proxy serving a model named "tiny",
# or CAPTURE_PROXY_UPSTREAM__SERVED_MODEL set); see docs/harnesses/claude-code.md.
set -euo pipefail
proxy="${1:-http://127.0.0.1:8100}"
prompt="${2:-List the files in this directory.}"
here="$(cd "$(dirname "$0")" && pwd)"
episode="$(curl -s "$proxy/episodes" -H 'content-type: application/json' -d '{"group_id": "example"}')"
base_url="$(python3 -c 'import json,sys; print(json.load(sys.stdin)["base_url"])' <<<"$episode")"
# Claude Code appends /v1/messages itself: give it the episode URL without /v1.
export ANTHROPIC_BASE_URL="${base_url%/v1}" ANTHROPIC_API_KEY=unused HOME="$(mktemp -d)"
export CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC=1 DISABLE_TELEMETRY=1 DISABLE_AUTOUPDATER=1 \
       DISABLE_ERROR_REPORTING=1
"$here/../../.venv/claude-code/node_modules/.bin/claude" -p "$prompt" --output-format json \
    --model tiny --allowedTools "Bash Agent" </dev/null
curl -s "${base_url%/v1}/close" -H 'content-type: application/json' -d '{"reward": 1.0, "wait_s": 30}'
echo
