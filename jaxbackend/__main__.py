"""Command line: `python -m jaxbackend <command> [args]`.

Each command lives in its own module with a `main(argv) -> int`; this file
only dispatches, so commands import nothing they do not use.
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "demo": ("jaxbackend._demo", "named multi-layer attention: jaxpr with named einsums, checked against jnp"),
    "explain": ("jaxbackend._explain", "run the pass pipeline on script.py:function (its example_inputs()) and print the report, "
                "with the source lines each pass changed; --corpus DIR: which passes fire on a corpus"),
    "train": ("jaxbackend.train._cli", "train a char-level GPT on the stdlib source: checkpoints, --resume, loss PNG, sample"),
}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        lines = [f"  {name:<10} {doc}" for name, (_, doc) in COMMANDS.items()]
        print("usage: python -m jaxbackend <command> [options]\n\ncommands:\n" + "\n".join(lines))
        if argv and argv[0] not in ("-h", "--help"):
            print(f"\nerror: unknown command {argv[0]!r}; choose one of {', '.join(COMMANDS)}.",
                  file=sys.stderr)
            return 2
        return 0
    module = importlib.import_module(COMMANDS[argv[0]][0])
    return int(module.main(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
