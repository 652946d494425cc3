#!/usr/bin/env bash
# The smallest Codex episode: open, run `codex exec` once against it, close with a reward.
# Usage: examples/codex/run.sh [PROXY_URL] ["prompt"]   (proxy serving a model named "tiny",
# or CAPTURE_PROXY_UPSTREAM__SERVED_MODEL set); see docs/harnesses/codex.md.
set -euo pipefail
proxy="${1:-http://127.0.0.1:8100}"
prompt="${2:-List the files in this directory.}"
here="$(cd "$(dirname "$0")" && pwd)"
episode="$(curl -s "$proxy/episodes" -H 'content-type: application/json' -d '{"group_id": "example"}')"
base_url="$(python3 -c 'import json,sys; print(json.load(sys.stdin)["base_url"])' <<<"$episode")"
export HOME="$(mktemp -d)" CAPTURE_API_KEY=unused
export CODEX_HOME="$HOME/.codex" && mkdir -p "$CODEX_HOME"
"$here/../../.venv/codex/node_modules/.bin/codex" exec --skip-git-repo-check \
    -c 'model_provider="capture"' -c 'model="tiny"' \
    -c "model_providers.capture={name=\"capture\", base_url=\"$base_url\", env_key=\"CAPTURE_API_KEY\", wire_api=\"responses\"}" \
    "$prompt" </dev/null
curl -s "${base_url%/v1}/close" -H 'content-type: application/json' -d '{"reward": 1.0, "wait_s": 30}'
echo
