"""Node B of the suite's two-node cluster (the ``two_nodes`` fixture) cannot see the driver's
files: Python started by that node's raylet (its workers put this directory on PYTHONPATH)
refuses to open anything under ``GROUPFLOW_DRIVER_ONLY``, as a disk of another machine would.

Design decision: both Ray nodes run on one machine, so every path exists on both; an audit hook
on ``open`` (and on listing or creating directories) is the cheapest way to make a path "only on
the driver's node" without root, namespaces or a second machine. It sees what Python opens, not
files opened by native code (safetensors' Rust reader, torch's C++ loaders).
"""

import os
import sys

_ROOT = os.environ.get("GROUPFLOW_DRIVER_ONLY")
_EVENTS = {"open", "os.listdir", "os.scandir", "os.mkdir", "os.rename", "os.remove"}


def _refuse(event, args):
    if event not in _EVENTS or not args:
        return
    path = args[0]
    if isinstance(path, int):  # an already-open file descriptor
        return
    try:
        path = os.path.abspath(os.fsdecode(path))
    except TypeError:
        return
    if path == _ROOT or path.startswith(_ROOT + os.sep):
        raise FileNotFoundError(f"{path} is on the driver's node only (not on node B)")


if _ROOT:
    sys.addaudithook(_refuse)
