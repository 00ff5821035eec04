"""Small, dependency-free helpers shared by the driver and the CLI: secrets/env and stage timing.

Design decision: only standard-library code lives here, so importing a utility never pulls in torch
or a logging backend.
"""

from groupflow.utils.env import load_dotenv_file, redact_secrets, require_env
from groupflow.utils.timing import StageTimer, throughput

__all__ = ["StageTimer", "load_dotenv_file", "redact_secrets", "require_env", "throughput"]
