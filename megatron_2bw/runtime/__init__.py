"""Running one stage's schedule in one process: executor, p2p, weight versions, grad sync."""
from .executor import PipelineExecutor, RunResult, Updater  # noqa: F401
from .p2p import StageLinks  # noqa: F401
