"""MkDocs hooks: the pages generated from the code — the configuration reference (from the
pydantic schema), the CLI reference (from its argparse parser) and the recipe catalogue (from the
example configs' own header comments).

Design decision: generated at build time from the one source each (never committed), so the site
cannot fall behind the code; the renderers are plain functions of their input, which
``tests/docs/test_docs.py`` calls directly.
"""

from __future__ import annotations

import argparse
import os
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


# A measured number written into prose goes stale the day the code changes: ratios, throughput,
# memory, timings and before → after pairs belong in a results file that the page renders. Config values,
# shapes (3×16×16) and targets stated as integers are not matched.
MEASURED = re.compile(
    r"(?<![\w.×])\d+\.\d+\s?×(?![\d])"
    r"|\b\d[\d.,]*\s?(?:tokens/s|steps/s|s/step|samples/s|episodes/s)\b"
    r"|\b\d+(?:\.\d+)?\s?(?:MiB|GiB|KiB)\b"
    r"|\b\d+\.\d+\s?→\s?\d+\.\d+"
    r"|\b\d+(?:\.\d+)?\s?%\s?→\s?\d+(?:\.\d+)?\s?%"  # accuracy before → after
    r"|\b\d+\.\d+\s?(?:s|ms)\b|\b\d+ min \d+ s\b"  # a timing (configured ones are integers)
)
_CODE = re.compile(r"^```.*?^```|`[^`\n]*`", re.S | re.M)


def measured_numbers(markdown: str) -> list[str]:
    """The lines of a page's prose (outside code, results placeholders and rendered blocks) that
    state a measured number, each as ``line N: text``."""
    blank = lambda m: "\n" * m.group(0).count("\n")  # noqa: E731 -- keeps line numbers
    prose = _CODE.sub(blank, SYNCED.sub(blank, markdown))
    return [f"line {i}: {line.strip()}" for i, line in enumerate(prose.splitlines(), 1)
            if MEASURED.search(line)]  # fmt: skip


RESULTS = re.compile(r"<!-- results: (\S+) -->")
# Markdown read outside the site (the README, benchmarks/README.md on GitHub) holds its tables
# rendered between these markers; `python docs/hooks.py` rewrites them, a test fails when stale.
SYNCED = re.compile(r"(<!-- rendered: (\S+) -->\n).*?(<!-- end rendered -->)", re.S)
SYNCED_FILES = ("README.md", "benchmarks/README.md")


SUMMARY = re.compile(r"<!-- summary: (\S+) -->")


def results_tables(markdown: str, at: str = "docs/index.md") -> str:
    """Each ``<!-- results: PATH -->`` in a page becomes that results file's table, each
    ``<!-- summary: NAME -->`` the summaries ``render_block(NAME)`` gives (``at``: the page's
    path from the repository root, which the summaries' links are relative to)."""
    from groupflow.utils.results import markdown_table, read_results

    markdown = SUMMARY.sub(lambda m: render_block(m.group(1), at), markdown)
    return RESULTS.sub(lambda m: markdown_table(read_results(ROOT / m.group(1))), markdown)


def _page_link(page: str, at: str) -> str:
    """A Markdown link to ``page`` (a path from the root) from the file ``at``: relative, so it
    works on GitHub and mkdocs checks it (``--strict``)."""
    target = os.path.relpath(ROOT / page, (ROOT / at).parent)
    return f"[{pathlib.Path(page).stem}]({pathlib.Path(target).as_posix()})"


def _summary_rows(folder: str, names: list[str] | None, first: str, at: str) -> list[str]:
    from groupflow.utils.results import read_results

    paths = sorted((ROOT / folder).glob("*.json"))
    if names is not None:
        by_stem = {p.stem: p for p in paths}
        unknown = [n for n in names if n not in by_stem]
        if unknown:
            raise ValueError(f"no results file {folder}/{unknown[0]}.json")
        paths = [by_stem[n] for n in names]
    lines = [f"| {first} | what is measured | before → after | details |", "|---|---|---|---|"]
    for path in paths:
        s = read_results(path)["summary"]
        where = _page_link(s["guide"], at) if s.get("guide") else ""
        lines.append(f"| {s['recipe']} | {s['what']} | {s['before']} → {s['after']} | {where} |")
    return lines


def readme_results(names: list[str] | None = None, at: str = "README.md") -> str:
    """The README's results table: one line per recipe's results file (``examples/results/NAME``
    beside ``examples/NAME.yaml``), or per named results file under examples/results/."""
    if names is None:
        names = sorted(p.stem for p in (ROOT / "examples" / "results").glob("*.json")
                       if (ROOT / "examples" / f"{p.stem}.yaml").is_file())  # fmt: skip
    return "\n".join(_summary_rows("examples/results", names, "recipe", at))


def benchmarks_summary(names: list[str] | None = None, at: str = "README.md") -> str:
    """One line per benchmark results file (all, or the named ones in that order)."""
    return "\n".join(_summary_rows("benchmarks/results", names, "benchmark", at))


def render_block(name: str, at: str = "README.md") -> str:
    """What a ``<!-- rendered: NAME -->`` block holds: ``recipes`` / ``recipes:A,B`` and
    ``benchmarks`` / ``benchmarks:A,B`` (the summaries of all or of those results files), or
    ``results:PATH`` (one file's table); ``at``: the file it is rendered into."""
    from groupflow.utils.results import markdown_table, read_results

    kind, _, arg = name.partition(":")
    if kind == "recipes":
        return readme_results(arg.split(",") if arg else None, at)
    if kind == "benchmarks":
        return benchmarks_summary(arg.split(",") if arg else None, at)
    if kind == "results":
        return markdown_table(read_results(ROOT / arg))
    raise ValueError(f"unknown rendered block {name!r}")


def sync_readme(check: bool = False) -> bool:
    """Rewrite (or with ``check`` only compare) the rendered blocks of the README and
    benchmarks/README.md; True when all already matched."""
    fresh = True
    for rel in SYNCED_FILES:
        path = ROOT / rel
        text = path.read_text()
        new = SYNCED.sub(
            lambda m, at=rel: f"{m.group(1)}{render_block(m.group(2), at)}\n{m.group(3)}", text
        )
        fresh &= new == text
        if not check and new != text:
            path.write_text(new)
    return fresh


def on_page_markdown(markdown, page, config, files):
    return results_tables(markdown, f"docs/{page.file.src_uri}")


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


if __name__ == "__main__":  # python docs/hooks.py: the READMEs' rendered tables from the files
    print(", ".join(SYNCED_FILES), "unchanged" if sync_readme() else "rewritten")
