"""docs/api.md is the app's OpenAPI document rendered (scripts/render_api_docs.py), up to date."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[3]


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "render_api_docs", ROOT / "scripts" / "render_api_docs.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_api_doc_is_not_stale() -> None:
    script = _script()
    expected = script.current()
    actual = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    assert actual == expected, "docs/api.md is stale: run python scripts/render_api_docs.py"


def test_the_doc_covers_every_route_and_the_error_shape() -> None:
    from capture_proxy.app import create_app
    from capture_proxy.settings import Settings

    spec = create_app(Settings()).openapi()
    text = _script().render(spec)
    for path, operations in spec["paths"].items():
        for method in operations:
            assert f"### `{method.upper()} {path}`" in text
    assert "/health`" not in text  # the alias is not documented twice
    # The app answers malformed requests with 400 error bodies, and the document says so.
    assert all(
        "422" not in op["responses"] for ops in spec["paths"].values() for op in ops.values()
    )
    assert "ErrorBody" in spec["components"]["schemas"]
    assert spec["paths"]["/readyz"]["get"]["responses"]["503"]
