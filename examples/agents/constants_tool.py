"""A tool for groupflow's multi-turn workflow: look up a physical constant by name.

Referenced from a config as (a file path relative to where you run groupflow, or a module path):

    rollout:
      max_turns: 3
      tools:
        - {function: examples/agents/constants_tool.py:lookup_constant}
        - {function: examples/agents/constants_tool.py:lookup_constant, label: constant_si,
           kwargs: {units: SI}}          # bound arguments are hidden from the model
        - {name: calculator}

A tool is a plain function with type hints and a Google-style docstring: groupflow turns both into
the JSON schema the model reads (through its chat template's ``tools=``, or a Hermes system prompt),
checks a call's arguments against it, runs the call on the driver with ``rollout.tool_timeout_s``
(or the entry's ``timeout_s``), and appends what it returns as a ``tool`` message (text; dicts and
lists as JSON; cut at ``rollout.max_tool_result_chars``). An exception becomes an error message the
model sees (``Error: KeyError: ...``) and is counted in ``rollout/tool_errors``; it never stops
the run. ``async def`` tools are awaited; code that can hang for real belongs in a subprocess
(see the ``python`` tool and ``groupflow.tools.sandbox``).
"""

from __future__ import annotations

_CONSTANTS = {
    "speed of light": (299_792_458.0, "m/s"),
    "planck constant": (6.626_070_15e-34, "J s"),
    "elementary charge": (1.602_176_634e-19, "C"),
    "avogadro constant": (6.022_140_76e23, "1/mol"),
    "boltzmann constant": (1.380_649e-23, "J/K"),
    "gravitational constant": (6.674_30e-11, "m^3/(kg s^2)"),
}


def lookup_constant(name: str, units: str = "SI") -> str:
    """Look up the value of a physical constant.

    Args:
        name: the constant's name, e.g. "speed of light" or "planck constant".
        units: the unit system of the answer; only "SI" is known.
    """
    key = name.strip().lower()
    if key not in _CONSTANTS:
        raise KeyError(f"unknown constant {name!r}; known: {sorted(_CONSTANTS)}")
    if units != "SI":
        raise ValueError(f"unknown unit system {units!r}; only SI is known")
    value, unit = _CONSTANTS[key]
    return f"{value:g} {unit}"
