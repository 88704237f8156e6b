"""`python -m megatron_2bw.planner [profile | profile-network] ...`: plan a run, or first
profile the layers or (under torchrun) the collectives' latency and bandwidth."""
from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["profile"]:
        from .profile import main as profile_main  # imports torch; planning does not
        return profile_main(argv[1:])
    if argv[:1] == ["profile-network"]:
        from .netprofile import main as network_main  # imports torch; planning does not
        return network_main(argv[1:])
    from .cli import main as plan_main
    return plan_main(argv)


if __name__ == "__main__":
    sys.exit(main())
