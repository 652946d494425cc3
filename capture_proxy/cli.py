"""``capture-proxy`` command line: one entry point, one module per sub-command.

Each sub-command module exposes ``main(argv: list[str]) -> int`` and is imported only when used,
so ``capture-proxy serve`` never imports torch.
"""

from __future__ import annotations

import importlib
import sys

COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("capture_proxy.serve", "run the proxy (OpenAI-compatible API + episode REST API)"),
    "make-tiny-model": ("capture_proxy.tiny_model", "build the deterministic tiny test model"),
    "export": ("capture_proxy.export", "write an episode bundle file from the store"),
    "reconstruct": ("reconstruct.cli", "turn bundles or closed episodes into training rows"),
    "train-step": ("trainer_bridge.cli", "GRPO advantages + one learner step on rows"),
    "demo": ("capture_proxy.demo", "end-to-end demo on a real vLLM with the tiny model"),
}


def _usage() -> str:
    lines = ["usage: capture-proxy COMMAND [ARGS]", "", "commands:"]
    lines += [f"  {name:<16} {text}" for name, (_, text) in COMMANDS.items()]
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
    module = importlib.import_module(COMMANDS[name][0])
    result: int = module.main(rest)
    return result


if __name__ == "__main__":
    raise SystemExit(main())
