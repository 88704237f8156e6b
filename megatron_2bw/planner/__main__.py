"""`python -m megatron_2bw.planner [profile] ...`: plan a run, or profile the layers first."""
from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["profile"]:
        from .profile import main as profile_main  # imports torch; planning does not
        return profile_main(argv[1:])
    from .cli import main as plan_main
    return plan_main(argv)


if __name__ == "__main__":
    sys.exit(main())
