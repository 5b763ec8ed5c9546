"""The runner: a Llama-family model generating through whichever layout the config names.

`kvlayout run` reads a RunConfig (runner.config), loads a model
(kvlayout.models), resolves the layout through the registry and drives it
with an engine of kvlayout.engines (runner.job); runner.resume saves and
resumes a run's files; runner.report prints what happened.
"""

from kvlayout.runner.config import RunConfig, load_config
from kvlayout.runner.job import RunResult, run

__all__ = ["RunConfig", "RunResult", "load_config", "run"]
