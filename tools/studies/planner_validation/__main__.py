"""`python -m planner_validation` (tools/studies/ and tools/ on sys.path): the command
line, or with `_worker RANK WORLD WORKDIR` one of the warm workers `workers.run_jobs`
starts."""
import sys

from .cli import main
from .workers import worker_main

if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_worker":
        sys.exit(worker_main(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]))
    sys.exit(main())
