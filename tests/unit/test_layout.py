"""The package layout holds: arrows point down, and the service loads no ML stack (issue 10).

Each check imports in a fresh interpreter, so what other tests imported cannot hide a violation.
A static pass over the sources catches lazy imports inside functions too.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SERVICE = {"capture_proxy", "capture_devkit"}
ML_STACK = {"torch", "transformers", "vllm", "ray", "openai"}


def _loaded_after(statement: str) -> set[str]:
    code = f"{statement}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    return set(json.loads(done.stdout.splitlines()[-1]))


def _top_level(modules: set[str]) -> set[str]:
    return {name.split(".")[0] for name in modules}


def _imported_packages(package: str) -> dict[str, set[str]]:
    """Top-level packages each module of ``package`` imports, anywhere in its body."""
    out: dict[str, set[str]] = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module.split(".")[0])
        out[str(path.relative_to(ROOT))] = names
    return out


def test_reconstruct_and_trainer_load_no_service_module() -> None:
    loaded = _loaded_after(
        "import reconstruct, reconstruct.cli, reconstruct.invariants\n"
        "import trainer_bridge.rows_io, trainer_bridge.batch, trainer_bridge.grpo\n"
        "import trainer_bridge.loss, trainer_bridge.learner, trainer_bridge.cli\n"
        "import trainer_bridge.ray_learner"
    )
    assert "reconstruct.core" in loaded and "trainer_bridge.learner" in loaded
    assert _top_level(loaded) & SERVICE == set()


def test_reconstruct_and_trainer_sources_name_no_service_module() -> None:
    for package in ("reconstruct", "trainer_bridge", "capture_contracts"):
        offenders = {m: n & SERVICE for m, n in _imported_packages(package).items() if n & SERVICE}
        assert offenders == {}, f"{package} imports the service: {offenders}"


def test_contracts_import_nothing_of_the_project_but_themselves() -> None:
    project = SERVICE | {"reconstruct", "trainer_bridge"}
    imported = _imported_packages("capture_contracts")
    assert {m: n & project for m, n in imported.items() if n & project} == {}


def test_importing_the_service_loads_no_ml_stack() -> None:
    loaded = _loaded_after(
        "import capture_proxy.app, capture_proxy.cli, capture_proxy.reconstruct_job\n"
        "import capture_proxy.commands.serve, capture_proxy.commands.db\n"
        "import capture_proxy.commands.export, capture_proxy.commands.reconstruct\n"
        "from capture_proxy.app import create_app\n"
        "create_app()"
    )
    assert "capture_proxy.proxy" in loaded and "reconstruct.core" in loaded
    assert _top_level(loaded) & ML_STACK == set()


def test_the_service_sources_import_no_ml_stack_and_no_dev_kit() -> None:
    imported = _imported_packages("capture_proxy")
    bad = {m: n & (ML_STACK | {"capture_devkit"}) for m, n in imported.items()}
    assert {m: n for m, n in bad.items() if n} == {}
