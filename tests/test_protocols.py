"""Every implementation of every seam Protocol conforms to it, checked structurally.

The seams (the rollout engine, source and transport, the policy's views, workflows, tool-call
parsers, sandboxes, ...) are ``typing.Protocol`` classes: nothing inherits them, so nothing but a
test notices an implementation that drifted — a missing member, a renamed or reordered parameter,
a parameter the caller does not pass that has no default. ``IMPLEMENTATIONS`` names each
Protocol's implementations; a scan of the package's source makes sure the list is complete (a
class that defines all of a Protocol's methods is either listed or named in ``NOT_ONE`` with the
reason), so a new implementation cannot skip the check.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import textwrap
from pathlib import Path
from typing import Protocol

import pytest

import groupflow

IMPLEMENTATIONS: dict[str, list[str]] = {
    "groupflow.rollout.engines.base:RolloutEngine": [
        "groupflow.rollout.engines.base:HFEngine",
        "groupflow.rollout.engines.vllm_engine:VLLMEngine",
    ],
    "groupflow.rollout.hosts:SideHost": [
        "groupflow.distributed.process:ProcessHost",
        "groupflow.rollout.hosts:ThreadHost",
        "groupflow.rollout.ray_host:PoolSideHost",
    ],
    "groupflow.rollout.source:RolloutSource": [
        "groupflow.rollout.source:SyncRollout",
        "groupflow.rollout.source:AsyncRolloutSource",
    ],
    "groupflow.distributed.transport:WeightTransport": [
        "groupflow.distributed.transport:DriverTransport",
        "groupflow.distributed.transport:FileTransport",
        "groupflow.distributed.transport:RayObjectTransport",
        "groupflow.distributed.transport:RingTransport",
        "groupflow.distributed.collective:CollectiveTransport",
    ],
    "groupflow.policies.base:Policy": [
        "groupflow.policies.llm:LLMPolicy",
        "groupflow.policies.diffusion:DiffusionPolicy",
    ],
    "groupflow.policies.base:PolicyView": [
        "groupflow.policies.llm:LLMPolicy",
        "groupflow.policies.diffusion:DiffusionPolicy",
        "groupflow.policies.base:RolloutView",
    ],
    "groupflow.policies.base:LLMPolicyView": ["groupflow.policies.llm:LLMPolicy"],
    "groupflow.policies.base:DiffusionPolicyView": [
        "groupflow.policies.diffusion:DiffusionPolicy",
        "groupflow.policies.base:RolloutView",
    ],
    "groupflow.workflows:Workflow": [
        "groupflow.workflows.single_turn:SingleTurnWorkflow",
        "groupflow.workflows.multi_turn:MultiTurnWorkflow",
        "groupflow.workflows.agent:AgentWorkflow",
        "groupflow.workflows.diffusion:DiffusionWorkflow",
    ],
    "groupflow.agents.parsers:ToolCallParser": [
        "groupflow.agents.parsers:HermesParser",
        "groupflow.agents.parsers:TagParser",
    ],
    "groupflow.agents.environments:Environment": [
        "groupflow.agents.environments:ToolEnvironment",
    ],
    "groupflow.agents.formats:TurnFormat": [
        "groupflow.agents.formats:ChatFormat",
        "groupflow.agents.formats:PlainFormat",
        "groupflow.agents.formats:VisionChatFormat",
    ],
    "groupflow.diffusion.models:FlowModel": [
        "groupflow.diffusion.models:TinyFlowModel",
        "groupflow.diffusion.models:DiffusersFlowModel",
    ],
    "groupflow.diffusion.models:PromptEncoder": [
        "groupflow.diffusion.models:HashPromptEncoder",
        "groupflow.diffusion.models:MaskedHashPromptEncoder",
        "groupflow.diffusion.encoders:WanTextEncoder",
        "groupflow.diffusion.text_encoders:SD3TextEncoder",
        "groupflow.diffusion.text_encoders:FluxTextEncoder",
        "groupflow.diffusion.text_encoders:Flux2TextEncoder",
        "groupflow.diffusion.text_encoders:QwenImageTextEncoder",
        "groupflow.diffusion.text_encoders:ZImageTextEncoder",
    ],
    "groupflow.serve.access:Access": [
        "groupflow.serve.access:OpenAccess",
        "groupflow.serve.recording:EpisodeRecorder",
    ],
    "groupflow.tools.sandbox:Sandbox": [
        "groupflow.tools.sandbox.bwrap:BwrapSandbox",
        "groupflow.tools.sandbox.guard:GuardSandbox",
        "groupflow.tools.sandbox.remote:RemoteSandbox",
    ],
    "groupflow.run.tracking_backends:LoggerBackend": [
        "groupflow.run.tracking:ConsoleBackend",
        "groupflow.run.tracking:JsonlBackend",
        "groupflow.run.tracking:Tracker",  # fans out to the backends: one itself
        "groupflow.run.tracking_backends:MlflowBackend",
        "groupflow.run.tracking_backends:TensorBoardBackend",
        "groupflow.run.tracking_backends:WandbBackend",
    ],
    "groupflow.rewards.scoring:Scorable": ["groupflow.rewards.base:RewardFunction"],
}

# classes that define all of a Protocol's method names without being one (the scan's false hits)
NOT_ONE = {
    ("Environment", "ContinuousDecoder"): "reset/step of a decoding loop, not an episode",
    ("Sandbox", "AgentLoop"): "run() of an episode loop",
    ("Sandbox", "AgentWorkflow"): "run() of a workflow",
    ("Sandbox", "MultiTurnWorkflow"): "run() of a workflow",
    ("Scorable", "RolloutSource"): "start(step) of the rollout source",
    ("Scorable", "SyncRollout"): "start(step) of the rollout source",
    ("Scorable", "AsyncRolloutSource"): "start(step) of the rollout source",
    ("Scorable", "ServerThread"): "start() of a thread",
    ("DiffusionPolicyView", "LLMPolicy"): "sync, the view's one method, is every policy's",
}


def _load(path: str):
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


def _protocol_members(proto: type) -> tuple[set[str], dict[str, inspect.Signature]]:
    """(attribute names, method name → signature) a Protocol declares, its Protocol bases' too."""
    attrs, methods = set(), {}
    for base in reversed(proto.__mro__):
        if base in (Protocol, object) or not getattr(base, "_is_protocol", False):
            continue
        attrs |= set(getattr(base, "__annotations__", {}))
        for name, value in vars(base).items():
            if isinstance(value, property):
                attrs.add(name)
            elif inspect.isfunction(value) and (not name.startswith("_") or name == "__call__"):
                methods[name] = inspect.signature(value)
    return attrs - set(methods), methods


def _assigned_attributes(cls: type) -> set[str]:
    """``self.<name>`` targets assigned anywhere in the class body's methods (incl. chained and
    tuple assignments): the instance attributes it sets."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if klass is object or not klass.__module__.startswith("groupflow"):
            continue
        tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        for node in ast.walk(tree):
            targets = []
            if isinstance(node, ast.Assign):
                targets = node.targets
            elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
                targets = [node.target]
            for t in targets:
                for e in ast.walk(t):
                    if isinstance(e, ast.Attribute) and isinstance(e.value, ast.Name):
                        if e.value.id == "self":
                            names.add(e.attr)
    return names


def _signature_problems(name: str, want: inspect.Signature, got: inspect.Signature) -> list[str]:
    """Why a call written against ``want`` would fail on ``got`` (both with ``self``)."""
    P = inspect.Parameter
    want_ps = [p for p in want.parameters.values()][1:]
    got_all = list(got.parameters.values())
    got_ps = got_all[1:] if got_all and got_all[0].name in ("self", "cls") else got_all
    var_pos = any(p.kind is P.VAR_POSITIONAL for p in got_ps)
    var_kw = any(p.kind is P.VAR_KEYWORD for p in got_ps)
    by_name = {p.name: p for p in got_ps}
    positional = [p for p in got_ps if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
    problems = []
    for i, p in enumerate(want_ps):
        if p.kind in (P.VAR_POSITIONAL, P.VAR_KEYWORD):
            kinds = {q.kind for q in got_ps}
            if p.kind not in kinds:
                problems.append(f"{name}: takes no {p}")
            continue
        q = by_name.get(p.name)
        if p.kind is P.POSITIONAL_OR_KEYWORD:
            if i < len(positional) and positional[i].name == p.name:
                q = positional[i]
            elif not var_pos or not var_kw:
                problems.append(f"{name}: parameter {i + 1} should be {p.name!r}")
                continue
        elif q is None and not var_kw:
            problems.append(f"{name}: no keyword parameter {p.name!r}")
            continue
        if q is not None and p.default is not P.empty and q.default is P.empty:
            problems.append(f"{name}: {p.name!r} has a default in the Protocol, none here")
    wanted = {p.name for p in want_ps}
    for q in got_ps:
        extra = q.name not in wanted and q.kind not in (P.VAR_POSITIONAL, P.VAR_KEYWORD)
        if extra and q.default is P.empty:
            problems.append(f"{name}: extra parameter {q.name!r} without a default")
    return problems


def conformance_problems(proto: type, cls: type) -> list[str]:
    attrs, methods = _protocol_members(proto)
    problems = []
    have = set(dir(cls)) | set(getattr(cls, "__dataclass_fields__", {})) | _assigned_attributes(cls)
    problems += [f"no attribute {a!r}" for a in sorted(attrs) if a not in have]
    for name, want in methods.items():
        impl = inspect.getattr_static(cls, name, None)
        if impl is None:
            problems.append(f"no method {name!r}")
            continue
        if isinstance(impl, staticmethod | classmethod):
            impl = impl.__func__
        if not callable(impl):
            problems.append(f"{name!r} is not a method")
            continue
        problems += _signature_problems(name, want, inspect.signature(impl))
    return problems


CASES = [(p, c) for p, impls in IMPLEMENTATIONS.items() for c in impls]


@pytest.mark.parametrize(("proto", "impl"), CASES, ids=[f"{p.split(':')[1]}-{c.split(':')[1]}"
                                                         for p, c in CASES])  # fmt: skip
def test_every_implementation_conforms_to_its_protocol(proto, impl):
    assert conformance_problems(_load(proto), _load(impl)) == []


def _source_classes() -> dict[str, set[str]]:
    """Class name → the method names its body defines, over the package's source (not the
    Protocols themselves: one that extends another defines its methods)."""
    root = Path(groupflow.__file__).parent
    found: dict[str, set[str]] = {}
    for f in root.rglob("*.py"):
        for node in ast.walk(ast.parse(f.read_text())):
            bases = {getattr(b, "id", getattr(b, "attr", "")) for b in getattr(node, "bases", [])}
            if isinstance(node, ast.ClassDef) and "Protocol" not in bases:
                defs = (ast.FunctionDef, ast.AsyncFunctionDef)
                found[node.name] = {n.name for n in node.body if isinstance(n, defs)}
    return found


def test_the_list_of_implementations_is_complete():
    classes = _source_classes()
    missing = []
    for proto_path, impls in IMPLEMENTATIONS.items():
        proto = _load(proto_path)
        _, methods = _protocol_members(proto)
        listed = {i.split(":")[1] for i in impls}
        for name, defined in classes.items():
            if name == proto.__name__ or not methods or not set(methods) <= defined:
                continue
            if name not in listed and (proto.__name__, name) not in NOT_ONE:
                missing.append(f"{name} defines {proto.__name__}'s methods but is not listed")
    assert missing == []


def test_the_check_catches_drift():
    """The checker itself: each kind of drift it exists for is reported."""

    class Seam(Protocol):
        name: str

        def run(self, job: int, limits: int = 0, *, timeout_s: float) -> int: ...

    class Good:
        name = "good"

        def run(self, job, limits=0, *, timeout_s, extra=None):
            return 0

    class Drifted:
        def __init__(self):
            self.label = "x"  # not ``name``

        def run(self, limits, job, timeout_s, must):  # swapped, and an extra one
            return 0

    class NoDefault:
        name = "x"

        def run(self, job, limits):  # a caller may leave out limits; must pass timeout_s
            return 0

    assert conformance_problems(Seam, Good) == []
    assert conformance_problems(Seam, Drifted) == [
        "no attribute 'name'",
        "run: parameter 1 should be 'job'",
        "run: parameter 2 should be 'limits'",
        "run: extra parameter 'must' without a default",
    ]
    assert conformance_problems(Seam, NoDefault) == [
        "run: 'limits' has a default in the Protocol, none here",
        "run: no keyword parameter 'timeout_s'",
    ]
    assert conformance_problems(Seam, type("Empty", (), {})) == [
        "no attribute 'name'",
        "no method 'run'",
    ]
