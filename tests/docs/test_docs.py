"""The documentation is tested like code: every config snippet validates against the schema, every
Python snippet compiles, every ``groupflow`` command parses and names files and keys that exist,
the generated reference pages cover the whole schema and CLI, and the site builds strictly."""

from __future__ import annotations

import importlib.util
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted((ROOT / "docs").rglob("*.md")) + [ROOT / "README.md"]
FENCE = re.compile(r"^```(\w+)\n(.*?)^```", re.S | re.M)


def _hooks():
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "docs" / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _blocks(lang: str) -> list[tuple[str, str]]:
    return [(str(p.relative_to(ROOT)), m.group(2)) for p in PAGES
            for m in FENCE.finditer(p.read_text()) if m.group(1) == lang]  # fmt: skip


def _commands() -> list[tuple[str, list[str]]]:
    """(page, argv after the program) of every ``groupflow`` command in a bash block."""
    out = []
    for page, block in _blocks("bash"):
        for line in block.replace("\\\n", " ").splitlines():
            argv = shlex.split(line, comments=True)
            if argv and argv[0].endswith("groupflow"):
                out.append((page, [a for a in argv[1:] if a != "&"]))
    return out


def _section_models():
    from groupflow.config import Config
    from groupflow.config.reference import _sections_in

    return {name: _sections_in(f.annotation) for name, f in Config.model_fields.items()}


def test_the_docs_hold_snippets_of_each_kind():
    assert len(_blocks("yaml")) >= 7 and len(_blocks("python")) >= 2 and len(_commands()) >= 30


@pytest.mark.parametrize("page,block", _blocks("yaml"), ids=lambda v: v[:40])
def test_every_config_snippet_validates_section_by_section(page, block):
    """A snippet is a fragment of a config: each of its sections must validate on its own (unknown
    keys, wrong types and bad values fail; what needs the rest of a config is not checked)."""
    from pydantic import BaseModel

    data = yaml.safe_load(block)
    assert isinstance(data, dict), f"{page}: a config snippet is a mapping"
    models = _section_models()
    for name, value in data.items():
        assert name in models, f"{page}: unknown top-level config key {name!r}"
        sections = models[name]
        if sections and isinstance(value, dict):
            errors = []
            for model in sections:
                try:
                    model.model_validate(value)
                    break
                except ValueError as e:
                    errors.append(str(e))
            else:
                pytest.fail(f"{page}: section {name!r} does not validate: {errors[0]}")
        assert not isinstance(value, BaseModel)


@pytest.mark.parametrize("page,block", _blocks("python"), ids=lambda v: v[:40])
def test_every_python_snippet_compiles(page, block):
    compile(block, page, "exec")


def test_every_groupflow_command_parses_and_names_existing_files_and_keys():
    from groupflow.cli.commands import _parse, build_parser
    from groupflow.config import Config
    from groupflow.config.reference import config_reference

    keys = {k.path for s in config_reference(Config) for k in s.keys}
    parser = build_parser()
    for page, argv in _commands():
        try:
            args = _parse(parser, argv)  # the CLI's own parsing (overrides anywhere)
        except SystemExit:
            pytest.fail(f"{page}: `groupflow {' '.join(argv)}` does not parse")
        config = getattr(args, "config", None)
        if config and config.startswith("examples/"):
            assert (ROOT / config).is_file(), f"{page}: {config} does not exist"
        for override in getattr(args, "overrides", []) or []:
            key = override.split("=", 1)[0]
            assert "=" in override and key in keys, f"{page}: {override!r} names no config key"


def test_a_snippet_with_a_bad_key_or_a_bad_command_is_caught():
    """The checks above can fail: the same code on broken input."""
    (model,) = _section_models()["rollout"]
    with pytest.raises(ValueError, match="max_stalenes"):
        model.model_validate({"max_stalenes": 1})
    from groupflow.cli.commands import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["trian", "examples/reverse_demo.yaml"])


def test_generated_pages_cover_every_key_command_and_example():
    from groupflow.cli.commands import build_parser
    from groupflow.config import Config
    from groupflow.config.reference import config_reference

    hooks = _hooks()
    config_page = hooks.config_markdown()
    for section in config_reference(Config):
        for key in section.keys:
            assert f"| `{key.path}` |" in config_page
    cli_page = hooks.cli_markdown()
    for name in hooks._subcommands(build_parser()):
        assert f"## `groupflow {name}`" in cli_page
    assert "--checkpoint" in cli_page and "--log-level" in cli_page
    recipes = hooks.recipes_markdown()
    for path in (ROOT / "examples").glob("*.yaml"):
        assert f"examples/{path.name}" in recipes


def test_every_page_is_in_the_navigation():
    nav = (ROOT / "mkdocs.yml").read_text()
    generated = set(_hooks().GENERATED)
    for page in (ROOT / "docs").rglob("*.md"):
        assert str(page.relative_to(ROOT / "docs")) in nav, f"{page} is not in mkdocs.yml's nav"
    for uri in generated:
        assert uri in nav


def test_the_site_builds_strictly(tmp_path):
    pytest.importorskip("mkdocs", reason="the docs extra (pip install -e .[docs])")
    run = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    home = (tmp_path / "site" / "index.html").read_text()
    assert "What it has, next to TRL and verl" in home
    reference = (tmp_path / "site" / "reference" / "config" / "index.html").read_text()
    assert "rollout.max_staleness" in reference


def test_every_results_file_is_valid_and_the_readme_table_is_rendered_from_them():
    from groupflow.utils.results import read_results

    files = sorted((ROOT / "examples" / "results").glob("*.json"))
    assert len(files) >= 6
    for path in [*files, *sorted((ROOT / "benchmarks" / "results").glob("*.json"))]:
        read_results(path)
    hooks = _hooks()
    assert hooks.sync_readme(check=True), "a README's rendered table is stale: python docs/hooks.py"
    recipes = hooks.readme_results()
    for path in (ROOT / "examples").glob("*.yaml"):  # every recipe's own results are in the table
        if (ROOT / "examples" / "results" / f"{path.stem}.json").is_file():
            assert read_results(ROOT / "examples" / "results" / f"{path.stem}.json")["summary"][
                "recipe"] in recipes  # fmt: skip
    shown = {n for page in NUMBER_PAGES for n in hooks.RESULTS.findall(page.read_text())}
    for path in files:  # and every other results file is on a page
        rel = str(path.relative_to(ROOT))
        assert (ROOT / "examples" / f"{path.stem}.yaml").is_file() or rel in shown, rel


def test_results_placeholders_become_tables_and_name_existing_files():
    hooks = _hooks()
    for page in PAGES:
        for name in hooks.RESULTS.findall(page.read_text()):
            assert (ROOT / name).is_file(), f"{page}: {name} does not exist"
    table = hooks.results_tables("x\n<!-- results: examples/results/calc_tools_demo.json -->\ny")
    assert table.startswith("x\n| ") and "44.5 % → 87.5 %" in table and table.endswith("\ny")


def test_the_measured_number_detector_finds_prose_numbers_and_spares_code_and_rendered_blocks():
    hooks = _hooks()
    found = hooks.measured_numbers(
        "groupflow is 1.69× TRL here\n"  # a ratio
        "it decodes 412 tokens/s\n"
        "a rank holds 513.1 MiB\n"
        "the reward went 0.46 → 0.97\n"
        "held-out accuracy 22.7 % → 85.9 %\n"
        "a collect took 0.874 s, the command 4 min 40 s\n"
        "the watch polls every 2 s, 120 steps of 16 prompts\n"  # a configured value, counts
        "a 3×16×16 image, 4 prompts × 8 samples, the issue's 3× target\n"  # shapes, targets
        "`1.5×` in code\n```text\n2.5× in a block\n```\n"
        "<!-- rendered: recipes -->\n| 0.1 → 0.9 |\n<!-- end rendered -->\n"
    )
    assert [line.split(":")[0] for line in found] == [
        "line 1",
        "line 2",
        "line 3",
        "line 4",
        "line 5",
        "line 6",
    ]


NUMBER_PAGES = [*PAGES, ROOT / "benchmarks" / "README.md"]


@pytest.mark.parametrize("page", NUMBER_PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_page_writes_a_measured_number_into_its_prose(page):
    """A measured number lives in a results file; a page shows it through a placeholder (or a
    rendered block), so it cannot go stale or disagree with another page."""
    stray = _hooks().measured_numbers(page.read_text())
    assert not stray, f"{page.relative_to(ROOT)}: measured numbers in prose:\n" + "\n".join(stray)


def test_every_benchmark_results_file_is_shown_and_names_a_script_that_rewrites_it():
    from groupflow.utils.results import read_results

    shown = {name for page in NUMBER_PAGES for name in _hooks().RESULTS.findall(page.read_text())}
    files = sorted((ROOT / "benchmarks" / "results").glob("*.json"))
    assert len(files) >= 15
    for path in files:
        rel = str(path.relative_to(ROOT))
        assert rel in shown, f"{rel} is on no page"
        command = read_results(path)["command"]
        script = next((w for w in shlex.split(command) if w.endswith(".py")), None)
        assert script and (ROOT / script).is_file(), f"{rel}: command {command!r} names no script"
        assert "--results" in (ROOT / script).read_text(), f"{script} cannot write {rel}"


def test_rendered_blocks_fail_on_an_unknown_block_or_file():
    hooks = _hooks()
    with pytest.raises(ValueError, match="unknown rendered block"):
        hooks.render_block("speed")
    with pytest.raises(ValueError, match="no results file benchmarks/results/nope.json"):
        hooks.render_block("benchmarks:nope")
    assert hooks.render_block("recipes") == hooks.readme_results()


def _kind_rows(text: str) -> list[str]:
    """The first cells of a Markdown table whose first header cell names diffusion model kinds."""
    rows, inside = [], False
    for line in text.splitlines():
        cells = (
            [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
        )
        if cells and cells[0] in ("kind", "`diffusion.model.kind`"):
            inside = True
        elif inside and not cells:
            break
        elif inside and not set(cells[0]) <= {"-"}:
            rows.append(cells[0].strip("`"))
    return rows


def test_the_kinds_tables_list_exactly_the_diffusion_model_kinds_the_config_takes():
    import typing

    from groupflow.config.diffusion import DiffusionModelConfig

    kinds = list(typing.get_args(DiffusionModelConfig.model_fields["kind"].annotation))
    assert _kind_rows((ROOT / "README.md").read_text()) == kinds
    assert _kind_rows((ROOT / "docs" / "guides" / "diffusion.md").read_text()) == kinds
