"""MkDocs hooks: the pages generated from the code — the configuration reference (from the
pydantic schema), the CLI reference (from its argparse parser) and the recipe catalogue (from the
example configs' own header comments).

Design decision: generated at build time from the one source each (never committed), so the site
cannot fall behind the code; the renderers are plain functions of their input, which
``tests/docs/test_docs.py`` calls directly.
"""

from __future__ import annotations

import argparse
import pathlib
import re

import yaml

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def config_markdown() -> str:
    from groupflow.config import Config
    from groupflow.config.reference import config_reference

    sections = config_reference(Config)
    n = sum(len(s.keys) for s in sections)
    out = [
        "# Configuration reference",
        "",
        f"All {n} keys of the run configuration, generated from the schema "
        "(`groupflow/config/`): a key's description is the comment beside it in the source. A "
        "config is YAML; any key can be overridden on the command line as a dotted "
        "`key=value` (`actor.lr=1e-5`, `run.loggers=[console,wandb]`). Unknown keys are errors "
        "that name the closest valid key. `[]` in a path marks an entry of a list.",
        "",
    ]
    for section in sections:
        title = section.path or "top level"
        out += [f"## `{title}`" if section.path else f"## {title}", ""]
        if section.description:
            out += [_cell(section.description), ""]
        out += ["| key | type | default | allowed | description |", "|---|---|---|---|---|"]
        for k in section.keys:
            out.append(
                f"| `{k.path}` | {_cell(k.type)} | `{_cell(k.default)}` | {_cell(k.allowed)} "
                f"| {_cell(k.description)} |"
            )
        out.append("")
    return "\n".join(out)


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:  # argparse exposes subparsers only through its actions
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _help_of(parser: argparse.ArgumentParser, name: str) -> str:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for choice in action._choices_actions:
                if choice.dest == name:
                    return choice.help or ""
    return ""


def cli_markdown() -> str:
    from groupflow.cli.commands import build_parser

    parser = build_parser()
    parser.prog = "groupflow"
    out = [
        "# Command line",
        "",
        "Generated from `groupflow/cli/commands.py`'s parser. Every command exits 2 with a one-line "
        "error naming the offending file, key or row on bad input (`--log-level DEBUG` adds the "
        "traceback).",
        "",
        "```text",
        parser.format_usage().strip(),
        "```",
        "",
    ]
    for name, sub in _subcommands(parser).items():
        sub.prog = f"groupflow {name}"
        out += [f"## `groupflow {name}`", "", _help_of(parser, name), "", "```text"]
        out += [sub.format_help().strip(), "```", ""]
    return "\n".join(out)


def _header(path: pathlib.Path) -> str:
    """The comment lines a config file opens with, verbatim."""
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line)
    return "\n".join(lines)


def recipes_markdown() -> str:
    out = [
        "# Recipes",
        "",
        "Every example config shipped in `examples/`, with what its own header says and the command "
        "that runs it (each is loaded and validated by `tests/test_config.py`), and its measured "
        "results where a results file (`examples/results/`) holds them.",
        "",
    ]
    for path in sorted((ROOT / "examples").glob("*.yaml")):
        cfg = yaml.safe_load(path.read_text()) or {}
        kind = "diffusion" if "diffusion" in cfg else "LLM"
        algo = (cfg.get("algorithm") or {}).get("preset") or (cfg.get("algorithm") or {}).get(
            "estimator", "grpo"
        )
        out += [f"## `{path.name}`", "", f"*{kind}, {algo}*", ""]
        out += ["```bash", f".venv/bin/groupflow train examples/{path.name}", "```", ""]
        results = ROOT / "examples" / "results" / f"{path.stem}.json"
        if results.is_file():  # rendered by on_page_markdown like any page's placeholder
            out += ["Measured:", "", f"<!-- results: examples/results/{results.name} -->", ""]
        header = _header(path)
        if header:
            out += ["```yaml", header, "```", ""]
    return "\n".join(out)


def _summary(path: pathlib.Path) -> str:
    """The first paragraph of a module's docstring (read, not imported), up to its first
    sentence's end when that paragraph is long."""
    import ast

    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    first = " ".join(doc.split("\n\n", 1)[0].split())
    match = re.match(r"(.{60,}?\.)\s", first) if len(first) > 200 else None
    return match.group(1) if match else first


def layout_markdown() -> str:
    """Every package and module of ``groupflow/`` with the opening of its docstring."""
    package = ROOT / "groupflow"
    out = [
        "# Layout",
        "",
        "Every module of the package with the opening of its docstring (generated from "
        "the source, so it lists what is there; each module's docstring goes on to state its "
        "design decision).",
        "",
    ]
    dirs = [package] + sorted(p for p in package.rglob("*") if p.is_dir()
                              and p.name != "__pycache__" and any(p.glob("*.py")))  # fmt: skip
    for folder in dirs:
        rel = folder.relative_to(ROOT).as_posix()
        init = folder / "__init__.py"
        out += [f"## `{rel}/`", ""]
        if init.is_file() and _summary(init):
            out += [_summary(init), ""]
        out += ["| module | what it is |", "|---|---|"]
        for module in sorted(folder.glob("*.py")):
            if module.name != "__init__.py":
                out.append(f"| `{module.name}` | {_cell(_summary(module))} |")
        out.append("")
    return "\n".join(out)


RESULTS = re.compile(r"<!-- results: (\S+) -->")
README_BEGIN, README_END = "<!-- results table: begin -->", "<!-- results table: end -->"


def results_tables(markdown: str) -> str:
    """Each ``<!-- results: PATH -->`` in a page becomes that results file's table."""
    from groupflow.utils.results import markdown_table, read_results

    return RESULTS.sub(lambda m: markdown_table(read_results(ROOT / m.group(1))), markdown)


def readme_results() -> str:
    """The README's results table: one line per results file under examples/results/."""
    from groupflow.utils.results import read_results

    lines = ["| recipe | what is measured | before → after | details |", "|---|---|---|---|"]
    for path in sorted((ROOT / "examples" / "results").glob("*.json")):
        s = read_results(path)["summary"]
        where = f"`{s['guide']}`" if s.get("guide") else ""
        lines.append(f"| {s['recipe']} | {s['what']} | {s['before']} → {s['after']} | {where} |")
    return "\n".join(lines)


def sync_readme(check: bool = False) -> bool:
    """Rewrite (or with ``check`` only compare) the README's table between its markers;
    True when it already matched."""
    path = ROOT / "README.md"
    text = path.read_text()
    head, rest = text.split(README_BEGIN, 1)
    _, tail = rest.split(README_END, 1)
    new = f"{head}{README_BEGIN}\n{readme_results()}\n{README_END}{tail}"
    if not check and new != text:
        path.write_text(new)
    return new == text


def on_page_markdown(markdown, page, config, files):
    return results_tables(markdown)


GENERATED = {
    "design/layout.md": layout_markdown,
    "reference/config.md": config_markdown,
    "reference/cli.md": cli_markdown,
    "recipes.md": recipes_markdown,
}


def on_files(files, config):
    from mkdocs.structure.files import File

    for uri, render in GENERATED.items():
        files.append(File.generated(config, uri, content=render()))
    return files


if __name__ == "__main__":  # python docs/hooks.py: the README's results table from the files
    print("README.md results table", "unchanged" if sync_readme() else "rewritten")
