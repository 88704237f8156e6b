"""Puts tools/ on sys.path, as running a tools/ script does, so the tests import the tool
packages `planner_validation` and `benchmarks`."""
import os
import sys

TOOLS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools")
if TOOLS not in sys.path:
    sys.path.insert(0, TOOLS)
