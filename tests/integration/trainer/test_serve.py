"""The saved model directory is servable by the real vLLM, with the updated weights."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from capture_devkit.engine import VLLMServer
from tests.support.rowkit import make_row, simple_rows, token_ids
from trainer_bridge.batch import collate
from trainer_bridge.grpo import with_advantages
from trainer_bridge.learner import Learner, LearnerConfig


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_serves_the_updated_model(tiny_model_dir: Path, tmp_path: Path) -> None:
    learner = Learner.from_dir(tiny_model_dir, LearnerConfig(lr=1e-2))
    learner.step(with_advantages(collate(simple_rows())))
    out = learner.save(tmp_path / "updated")
    original = Learner.from_dir(tiny_model_dir)

    prompt = token_ids(12, seed=99)
    with VLLMServer(out, served_model_name="updated", log_path=tmp_path / "vllm.log") as server:
        response = httpx.post(
            f"{server.base_url}/v1/completions",
            json={
                "model": "updated",
                "prompt": prompt,
                "max_tokens": 8,
                "temperature": 1.0,
                "seed": 0,
                "logprobs": 0,
                "return_token_ids": True,
            },
            timeout=120.0,
        )
    response.raise_for_status()
    choice = response.json()["choices"][0]
    sampled, served = choice["token_ids"], choice["logprobs"]["token_logprobs"]
    assert len(sampled) == len(served) > 0

    ids = prompt + sampled
    row = make_row("r", "e", "g", 0.0, ids, [(len(prompt), len(ids))])
    batch = collate([row])
    span = slice(len(prompt), len(ids))
    updated_lp = learner.token_logprobs(batch)[0, span]
    original_lp = original.token_logprobs(batch)[0, span]
    diff = (updated_lp - updated_lp.new_tensor(served)).abs().max().item()
    moved = (original_lp - updated_lp).abs().max().item()
    print(f"max |learner - vLLM| = {diff:.2e}; update moved logprobs by up to {moved:.2e}")
    assert diff < 1e-3
    assert moved > 10 * diff  # vLLM serves the updated weights, not the original ones
