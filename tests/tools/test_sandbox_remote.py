"""The remote backend against a local service that speaks SandboxFusion's ``/run_code`` API (a
FastAPI app on 127.0.0.1 that runs each request in the OS sandbox, as a real service runs it in
a container), plus replies a real service may give: errors, retries, malformed bodies."""

import base64
import json
import socket
import threading
import time

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from groupflow.rewards.code import make_code_tests_reward
from groupflow.tools import python_tool, run_python
from groupflow.tools.sandbox import SandboxError, resolve_sandbox
from groupflow.tools.sandbox.remote import RemoteSandbox, echo_source


class Service:
    """A SandboxFusion-shaped service; ``script`` lists canned replies to give before real ones."""

    def __init__(self):
        self.requests: list[dict] = []
        self.script: list = []
        app = FastAPI()

        @app.post("/run_code")
        async def run_code(request: Request):
            body = await request.json()
            self.requests.append({"body": body, "headers": dict(request.headers)})
            if self.script:
                status, reply = self.script.pop(0)
                if isinstance(reply, str):
                    return PlainTextResponse(reply, status_code=status)
                return JSONResponse(reply, status_code=status)
            files = {k: base64.b64decode(v) for k, v in body.get("files", {}).items()}
            result = run_python(
                body["code"],
                stdin=body.get("stdin", ""),
                files=files,
                timeout_s=body["run_timeout"],
                memory_mb=body["memory_limit_MB"],
            )
            status = "TimeLimitExceeded" if result.timed_out else "Finished"
            return {
                "status": "Success" if result.exit_code == 0 else "Failed",
                "message": "",
                "compile_result": None,
                "run_result": {
                    "status": status,
                    "execution_time": result.duration_s,
                    "return_code": None if result.timed_out else result.exit_code,
                    "stdout": result.stdout,
                    "stderr": result.stderr,
                },
                "files": {},
            }

        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="error")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert time.monotonic() < deadline, "the stub service did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=10)


@pytest.fixture(scope="module")
def service():
    with Service() as running:
        yield running


@pytest.fixture(autouse=True)
def fresh_script(service):
    service.script.clear()
    service.requests.clear()


def remote(service, **options):
    return {"backend": "remote", "url": service.url, "backoff_s": 0.01, **options}


def test_runs_code_with_stdin_files_and_limits(service):
    result = run_python(
        "import sys\nprint(open('data.txt').read(), sys.stdin.read())",
        stdin="world",
        files={"data.txt": "hello"},
        timeout_s=3,
        memory_mb=256,
        sandbox=remote(service),
    )
    assert (result.stdout, result.exit_code, result.limit, result.backend) == (
        "hello world\n",
        0,
        None,
        "remote",
    )
    body = service.requests[0]["body"]
    assert body["language"] == "python" and body["run_timeout"] == 3
    assert body["memory_limit_MB"] == 256 and body["stdin"] == "world"
    assert base64.b64decode(body["files"]["data.txt"]) == b"hello"


def test_errors_timeouts_and_output_caps_map_to_the_same_result(service):
    spec = remote(service)
    failed = run_python("x = 1\n1 / 0", sandbox=spec)
    assert failed.exit_code == 1 and failed.error_line == "ZeroDivisionError: division by zero"
    slow = run_python("import time\ntime.sleep(5)", timeout_s=0.5, sandbox=spec)
    assert slow.limit == "wall_time" and slow.timed_out and slow.killed
    flood = run_python("print('x' * 5000)", max_output_bytes=100, sandbox=spec)
    assert flood.limit == "output" and flood.stdout_truncated and len(flood.stdout) == 100
    hog = run_python("x = bytearray(2 * 1024**3)", memory_mb=128, sandbox=spec)
    assert hog.limit == "memory"


def test_the_python_tool_echoes_the_last_expression_remotely(service):
    tool = python_tool(sandbox=remote(service))
    assert tool("x = 6\nx * 7") == "42"
    assert tool("print('a')\n1 / 0") == "a\nZeroDivisionError: division by zero (line 2)"


def test_code_rewards_run_remotely(service):
    reward = make_code_tests_reward(timeout_s=2.0, sandbox=remote(service))
    code = "```python\ndef add(a, b):\n    return a + b\n```"
    tests = [["assert add(1, 2) == 3", "assert add(2, 2) == 4"]]
    assert reward(completions=[code], tests=tests) == [1.0]
    stdio = json.dumps({"inputs": ["2\n"], "outputs": ["4\n"]})
    assert reward(completions=["```python\nprint(int(input()) * 2)\n```"], tests=[stdio]) == [1.0]


def test_server_errors_are_retried_with_backoff(service):
    service.script += [(503, "busy"), (500, {"detail": "oops"})]
    result = run_python("print(1)", sandbox=remote(service, retries=2))
    assert result.stdout == "1\n" and len(service.requests) == 3


@pytest.mark.parametrize(
    ("reply", "message"),
    [
        ((503, "busy"), "HTTP 503"),
        ((200, "not json"), "the reply is not JSON"),
        ((200, [1, 2]), "the reply is not an object"),
        ((200, {"status": "SandboxError", "message": "no pods"}), "message 'no pods', no run"),
        ((200, {"status": "Success", "run_result": {"status": "Finished"}}), "without an integer"),
        ((400, {"detail": "bad language"}), "HTTP 400"),
    ],
)
def test_a_failing_service_is_a_sandbox_error(service, reply, message):
    service.script += [reply] * 3
    with pytest.raises(SandboxError, match=message):
        run_python("print(1)", sandbox=remote(service, retries=0))


def test_a_failing_service_costs_the_tool_call_not_the_run(service):
    """The tool raises (its reply is never the program's output); a tool environment makes that
    an error observation, counted in sandbox_failures."""
    import asyncio
    import json

    from groupflow.agents.environments import ToolEnvironment
    from groupflow.agents.parsers import build_parser
    from groupflow.agents.tools import make_tool

    service.script += [(200, "garbage")] * 2
    tool = python_tool(sandbox=remote(service, retries=0))
    with pytest.raises(SandboxError, match="the reply is not JSON"):
        tool("print(1)")
    env = ToolEnvironment([make_tool(tool, "python", None, 30)], build_parser("hermes"))
    call = json.dumps({"name": "python", "arguments": {"code": "print(1)"}})
    messages, _, _ = asyncio.run(env.step(f"<tool_call>{call}</tool_call>"))
    assert messages[-1]["content"].startswith("Error: python could not run (its code sandbox")
    assert env.stats["sandbox_failures"] == 1 and env.stats["tool_errors"] == 0


def test_an_unreachable_service_is_a_sandbox_error():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    spec = {"backend": "remote", "url": f"http://127.0.0.1:{port}", "retries": 1, "backoff_s": 0}
    with pytest.raises(SandboxError, match="ConnectionError"):
        run_python("print(1)", sandbox=spec)


def test_api_key_comes_from_the_environment(service, monkeypatch):
    monkeypatch.setenv("TEST_SANDBOX_KEY", "sk-sandbox")
    run_python("print(1)", sandbox=remote(service, api_key_env="TEST_SANDBOX_KEY"))
    assert service.requests[0]["headers"]["authorization"] == "Bearer sk-sandbox"
    with pytest.raises(ValueError, match="'NOT_SET_ANYWHERE', which is not set"):
        resolve_sandbox(remote(service, api_key_env="NOT_SET_ANYWHERE"))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"url": "ftp://x"}, "url must be an http"),
        ({"url": "http://x", "retries": -1}, "retries must be an integer >= 0"),
        ({"url": "http://x", "backoff_s": "1"}, "backoff_s must be a number >= 0"),
    ],
)
def test_bad_options_name_themselves(options, message):
    with pytest.raises(ValueError, match=message):
        RemoteSandbox(**options)
    with pytest.raises(ValueError, match="unexpected keyword argument 'colour'"):
        resolve_sandbox({"backend": "remote", "url": "http://x", "colour": 1})


def test_a_url_alone_means_the_remote_backend(service):
    assert resolve_sandbox(service.url).name == "remote"


def test_echo_source_keeps_line_numbers():
    assert echo_source("x = 6\nx * 7") == (
        "x = 6\n__groupflow_value = (x * 7)\nif __groupflow_value is not None:\n"
        "    print(repr(__groupflow_value))\n"
    )
    assert echo_source("x = 1") == "x = 1"  # no final expression
    assert echo_source("def f(:") == "def f(:"  # the service reports the SyntaxError
    namespace: dict = {}
    exec(echo_source("print('a')\nNone"), namespace)  # None is not printed
