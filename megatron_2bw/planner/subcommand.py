"""The planner subcommands' argument parser (profile, profile-network, ...)."""
from __future__ import annotations

import argparse
import sys
from typing import NoReturn


class SubcommandParser(argparse.ArgumentParser):
    """A planner subcommand's parser: a bad flag is one line naming the subcommand."""

    def error(self, message: str) -> NoReturn:
        sys.stderr.write(f"{self.prog}: error: {message}\n")
        raise SystemExit(2)
