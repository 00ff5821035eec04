"""The calculator environment's server: OpenEnv's ``create_app`` (HTTP + the WebSocket sessions
its ``EnvClient`` speaks), up to 256 sessions at once (one per concurrent episode)."""

from openenv.core.env_server.http_server import create_app

try:
    from ..models import CalcAction, CalcObservation
    from .calc_environment import CalcEnvironment
except ImportError:  # served from inside the package directory
    from models import CalcAction, CalcObservation
    from server.calc_environment import CalcEnvironment

app = create_app(CalcEnvironment, CalcAction, CalcObservation, env_name="calc_openenv",
                 max_concurrent_envs=256)  # fmt: skip
