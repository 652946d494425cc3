"""The episode viewer in headless Chromium, on an episode a real vLLM served through the proxy.

The scripted harness (parent, two overlapping workers, compaction) runs against the tiny model;
the page is opened while the episode is open (calls and links, no rows) and after it is closed
(rows with owned and masked spans). Screenshots are kept under test-artifacts/.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from capture_contracts.bundle import parse_bundle
from capture_devkit.engine import VLLMServer, free_port
from capture_devkit.harness import close_episode, fetch_bundle, open_episode, run_episode
from capture_devkit.server_thread import ProxyThread
from capture_proxy.settings import Settings, StoreSettings, UpstreamSettings
from reconstruct import reconstruct_episode
from tests.fixtures.db import sqlite_url


def _shoot(driver: Any, path: Path) -> None:
    """A screenshot of the whole page (the window grown to the document's height)."""
    height = driver.execute_script("return document.documentElement.scrollHeight")
    driver.set_window_size(1400, min(max(int(height) + 40, 600), 6000))
    assert driver.save_screenshot(str(path))
    assert path.stat().st_size > 10_000  # a picture, not an empty page


def _check_nodes(driver: Any, bundle: dict[str, Any]) -> None:
    from selenium.webdriver.common.by import By

    nodes = driver.find_elements(By.CSS_SELECTOR, "svg.timeline g.call-node")
    assert sorted(n.get_attribute("data-call-id") for n in nodes) == sorted(
        c["call_id"] for c in bundle["calls"]
    )
    for node in nodes:
        rect = node.find_element(By.TAG_NAME, "rect")
        assert rect.rect["width"] > 0 and rect.rect["height"] > 0  # laid out, on the page
    agents = {c["agent_id"] or "(unlabelled)" for c in bundle["calls"]}
    lanes = [t.text for t in driver.find_elements(By.CSS_SELECTOR, "svg text.lane-label")]
    assert sorted(lanes) == sorted(a[:20] for a in agents)


def test_viewer_in_chromium(
    vllm_server: VLLMServer,
    tmp_path: Path,
    browser: Any,
    keep_artifact: Callable[[Path], Path],
) -> None:
    from selenium.webdriver.common.by import By

    settings = Settings(
        port=free_port(),
        store=StoreSettings(url=sqlite_url(tmp_path / "capture.db")),
        upstream=UpstreamSettings(url=vllm_server.base_url),
    )
    with ProxyThread(settings) as proxy:
        episode_id, base_url = asyncio.run(open_episode(proxy.url, "viewer", "viewer-ep"))
        asyncio.run(run_episode(base_url, episode_id=episode_id, group_id="viewer", seed=3))
        page = httpx.get(f"{proxy.url}/episodes/{episode_id}/view", timeout=30)
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")

        browser.get(f"{proxy.url}/episodes/{episode_id}/view")
        open_bundle = asyncio.run(fetch_bundle(proxy.url, episode_id))
        _check_nodes(browser, open_bundle)
        assert browser.find_elements(By.CSS_SELECTOR, "div.row") == []
        assert "rows are built once it is closed" in browser.find_element(By.TAG_NAME, "body").text
        _shoot(browser, tmp_path / "open.png")
        keep_artifact(tmp_path / "open.png")

        closed = asyncio.run(close_episode(proxy.url, episode_id, 1.0, wait_s=10.0))
        assert closed.status_code == 200
        bundle = asyncio.run(fetch_bundle(proxy.url, episode_id))
        browser.get(f"{proxy.url}/episodes/{episode_id}/view")
        _check_nodes(browser, bundle)
        result = reconstruct_episode(parse_bundle(bundle))
        links = browser.find_elements(By.CSS_SELECTOR, "svg.timeline path.parent-link")
        assert len(links) == sum(1 for p in result.parents.values() if p is not None) > 0
        rows = browser.find_elements(By.CSS_SELECTOR, "div.row")
        assert [r.get_attribute("data-row-id") for r in rows] == [r.row_id for r in result.rows]
        owned = browser.find_elements(By.CSS_SELECTOR, "div.row .seg.owned")
        assert len(owned) == sum(1 for r in result.rows for s in r.spans if s.owned)
        colour = owned[0].value_of_css_property("background-color")
        assert colour not in {"rgba(0, 0, 0, 0)", "rgb(238, 238, 238)"}  # owned ≠ prompt grey
        roles = {
            n.get_attribute("data-role")
            for n in browser.find_elements(By.CSS_SELECTOR, "g.call-node")
        }
        assert "compaction" in roles  # the script's compaction call is drawn with its role
        _shoot(browser, tmp_path / "closed.png")
        keep_artifact(tmp_path / "closed.png")
