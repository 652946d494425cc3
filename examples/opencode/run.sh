#!/usr/bin/env bash
# The smallest OpenCode episode: open, run OpenCode once against it, close with a reward.
# Usage: examples/opencode/run.sh [PROXY_URL] ["prompt"]   (proxy serving a model named "tiny")
set -euo pipefail
proxy="${1:-http://127.0.0.1:8100}"
prompt="${2:-List the files in this directory.}"
here="$(cd "$(dirname "$0")" && pwd)"
episode="$(curl -s "$proxy/episodes" -H 'content-type: application/json' -d '{"group_id": "example"}')"
export CAPTURE_BASE_URL="$(python3 -c 'import json,sys; print(json.load(sys.stdin)["base_url"])' <<<"$episode")"
export CAPTURE_API_KEY=unused OPENCODE_CONFIG_CONTENT="$(cat "$here/opencode.json")" HOME="$(mktemp -d)"
export OPENCODE_DISABLE_AUTOUPDATE=1 OPENCODE_DISABLE_MODELS_FETCH=1 OPENCODE_DISABLE_LSP_DOWNLOAD=1 \
       OPENCODE_DISABLE_SHARE=1 OPENCODE_DISABLE_DEFAULT_PLUGINS=1
echo "$prompt" | "$here/../../.venv/opencode/node_modules/.bin/opencode" run --format json --title example
curl -s "${CAPTURE_BASE_URL%/v1}/close" -H 'content-type: application/json' -d '{"reward": 1.0, "wait_s": 30}'
echo
