"""Read docker/Dockerfile and docker/compose.yaml the way Docker would, for the deploy tests.

No Docker engine runs here: the tests check what can be checked without one (the files parse,
name only real settings and commands) and run the image's commands directly.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).parents[2]
DOCKERFILE = ROOT / "docker" / "Dockerfile"
COMPOSE = ROOT / "docker" / "compose.yaml"
_DEFAULT = re.compile(r"\$\{([A-Z0-9_]+):-([^}]*)\}")


@dataclass(frozen=True)
class Image:
    """The final stage of the Dockerfile."""

    base: str
    env: dict[str, str]
    user: str | None
    entrypoint: list[str]
    cmd: list[str]
    healthcheck: list[str]
    copied: list[str]  # sources of COPY instructions (all stages, from the build context)


def _logical_lines(text: str) -> list[str]:
    lines, current = [], ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        lines.append(current + line)
        current = ""
    return lines


def _exec_form(value: str) -> list[str]:
    parsed = json.loads(value)
    assert isinstance(parsed, list) and all(isinstance(v, str) for v in parsed), value
    return parsed


def read_image(path: Path = DOCKERFILE) -> Image:
    args: dict[str, str] = {}
    base, env, user = "", {}, None
    entrypoint: list[str] = []
    cmd: list[str] = []
    healthcheck: list[str] = []
    copied: list[str] = []
    for line in _logical_lines(path.read_text()):
        word, _, rest = line.partition(" ")
        word = word.upper()
        if word == "ARG" and "=" in rest:
            name, value = rest.split("=", 1)
            args[name] = value
        elif word == "FROM":
            base = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], rest.split()[0])
            env, user = {}, None  # a new stage
        elif word == "ENV":
            env.update(dict(item.split("=", 1) for item in shlex.split(rest)))
        elif word == "USER":
            user = rest.strip()
        elif word == "ENTRYPOINT":
            entrypoint = _exec_form(rest)
        elif word == "CMD":
            cmd = _exec_form(rest)
        elif word == "HEALTHCHECK":
            healthcheck = _exec_form(rest.split(" CMD ", 1)[1])
        elif word == "COPY" and "--from" not in rest:
            copied += shlex.split(rest)[:-1]
    return Image(base, env, user, entrypoint, cmd, healthcheck, copied)


def read_compose(path: Path = COMPOSE) -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(path.read_text())
    return data


def with_defaults(value: str) -> str:
    """Compose's ``${VAR:-default}`` interpolation with nothing set: the defaults."""
    return _DEFAULT.sub(lambda m: m.group(2), value)
