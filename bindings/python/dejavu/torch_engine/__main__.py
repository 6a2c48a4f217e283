"""``python -m dejavu.torch_engine stage ...`` (a stage process of the Python driver), ``... member
...`` (the engine process of a ``dejavud stage``) or ``... demo ...`` (the demo)."""

import os
import sys


def main() -> int:
    commands = {"stage", "member", "demo"}
    if len(sys.argv) < 2 or sys.argv[1] not in commands:
        print("usage: python -m dejavu.torch_engine {stage|member|demo} [--help]", file=sys.stderr)
        return 2
    if sys.argv[1] == "stage":
        from .stage import main as run
    elif sys.argv[1] == "member":
        # Standard output carries the engine protocol: redirected before the imports, which may print.
        out = os.fdopen(os.dup(1), "wb")
        os.dup2(2, 1)
        from .member import main as member

        return member(sys.argv[2:], out)
    else:
        from .demo import main as run
    return run(sys.argv[2:])


if __name__ == "__main__":
    sys.exit(main())
