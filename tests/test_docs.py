"""The documentation, held to the code: every shell block in README.md and docs/ says how the suite runs it
(`<!-- run -->`: on this machine's CPU, `<!-- run-slurm -->`: against the local Slurm cluster, `<!-- check -->`:
a GPU cluster's command, parsed by the CLI and its config and layout checked by `plan`), every test or
benchmark a page names exists, and README stays a short page that maps every doc."""

from __future__ import annotations

import ast
import contextlib
import functools
import importlib.util
import io
import json
import re
import shlex
import subprocess
from pathlib import Path

import pytest

from hpc_train.cli import main, parse_args
from hpc_train.launch.sweep import combinations, sweep_axes
from tests.conftest import ROOT, run_cli

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
GENERATED = {ROOT / "docs" / "configuration.md"}  # tested against the schema in test_config
SHELL = {"bash", "sh", "shell", "console"}
MODES = ("run", "run-slurm", "check")
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```[ \t]*$", re.M | re.S)
MARK = re.compile(r"<!-- (\S+) -->\s*$")
# a path of this repository (a peer's, as `Megatron-LM/tools/x.py`, is not one)
REFERENCE = re.compile(r"(?<![\w/.-])(tests/test_\w+\.py)(?:::(\w+))?|(?<![\w/.-])(tools/[\w/]+\.py)")
README_LINES = 210


def shell_blocks() -> list[tuple[str, str, str]]:
    """(where, mode, text) of every shell block, in page order; mode is the marker on the line above, or ''."""
    blocks = []
    for page in PAGES:
        text = page.read_text()
        for fence in FENCE.finditer(text):
            if fence.group(1) not in SHELL:
                continue
            line = text.count("\n", 0, fence.start()) + 1
            before = text[: fence.start()].rstrip("\n").rsplit("\n", 1)[-1]
            mark = MARK.search(before)
            blocks.append((f"{page.relative_to(ROOT)}:{line}", mark.group(1) if mark else "", fence.group(2)))
    return blocks


def commands(block: str) -> list[tuple[str, list[str]]]:
    """The block's commands: each line as written (continuation lines joined) and as an argument list,
    comments dropped."""
    joined = re.sub(r"\\\n\s*", " ", block)
    return [(line, words) for line in joined.splitlines() if (words := shlex.split(line, comments=True))]


def test_every_shell_block_says_how_it_is_run():
    blocks = shell_blocks()
    assert len(blocks) >= 10
    unmarked = [where for where, mode, _ in blocks if mode not in MODES]
    assert not unmarked, f"mark each shell block with <!-- run -->, <!-- run-slurm --> or <!-- check -->: {unmarked}"
    assert {mode for _, mode, _ in blocks} == set(MODES)


def run_blocks(mode: str, scratch: Path) -> str:
    """The blocks of one mode in page order, from a scratch directory that sees the repository's configs,
    docs, tools and sources as a checkout does: each `hpc-train` command by the CLI's own `main` in this
    process (`run_cli`: a new interpreter's imports left out), any other line by bash. Returns their output;
    a failing command fails the test, naming its block."""
    for name in ("configs", "docs", "tools", "hpc_train"):
        (scratch / name).symlink_to(ROOT / name)
    output = []
    for where, block_mode, text in shell_blocks():
        if block_mode != mode:
            continue
        for line, words in commands(text):
            if words[0] == "hpc-train":
                result = run_cli(*words[1:], cwd=scratch, timeout_s=600)
            else:
                result = subprocess.run(line, shell=True, cwd=scratch, capture_output=True, text=True)
            output.append(result.stdout + result.stderr)
            assert result.returncode == 0, f"{where}: `{line.strip()}` failed:\n{output[-1][-4000:]}"
    return "".join(output)


def test_runnable_blocks_run_on_cpu(tmp_path):
    """The blocks a user runs on one machine, as written: quick start, resume, checkpoints, plan, data, export,
    each doing what its comment says (the resumes resume; LoRA starts from the imported weights)."""
    output = run_blocks("run", tmp_path)
    for run, step in (("tiny", 20), ("ckpt", 4), ("blend", 4)):
        assert f"resumed from runs/{run}/checkpoints/step_{step:07d}" in output, run
    for folder in ("tiny", "base", "lora"):
        assert (tmp_path / "hf" / folder / "model.safetensors").is_file(), folder
    first = [json.loads(line)["loss"] for line in (tmp_path / "runs" / "lora" / "metrics.jsonl").open()][0]
    assert first < 5.2  # the base's trained weights (a fresh model starts at ~5.55)


def plan_output(argv: list[str], where: str) -> str:
    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            main(["plan", *argv])
    except SystemExit:
        pytest.fail(f"{where}: `hpc-train plan {' '.join(argv)}` is refused:\n{err.getvalue()}")
    return out.getvalue()


def test_cluster_blocks_parse_and_their_layouts_check():
    """A block for a GPU cluster: each `hpc-train` command parses as the CLI reads it; a `plan` runs as written
    (a `--search`, seconds to minutes, only parses); a run or a submission's config and layout pass `plan`'s
    checks (the cluster's, without this machine's limits or the data files) and fit the config's GPU memory,
    as `submit` requires, and so does every member of a sweep. `model.init_from` is left out there: the config
    gives the shape it would."""
    for where, mode, text in shell_blocks():
        if mode != "check":
            continue
        checked = 0
        for _, words in commands(text):
            tools = [word for word in words if word.startswith("tools/")]
            assert all((ROOT / tool).is_file() for tool in tools), f"{where}: {tools}"
            checked += bool(tools)
            if words[0] == "make":  # the Makefile has the target (a dry run: nothing is made)
                made = subprocess.run(["make", "-n", *words[1:]], cwd=ROOT, capture_output=True, text=True)
                assert made.returncode == 0, f"{where}: make {words[1:]}: {made.stderr}"
                checked += 1
            if "hpc-train" not in words:
                continue  # the setup's own lines (venv, pip) and tools, found above
            argv = words[words.index("hpc-train") + 1 :]
            try:
                args = parse_args(argv)
            except SystemExit:
                pytest.fail(f"{where}: `hpc-train {' '.join(argv)}` does not parse")
            world = srun_world(words[: words.index("hpc-train")])
            if args.command == "plan" and not args.search:
                assert plan_output(argv[1:], where), where
            if args.command in ("train", "submit", "doctor", "sweep", "ladder") and args.config != "fit":
                overrides = [item for item in args.overrides if not item.startswith("model.init_from=")]
                shared, axes = sweep_axes(overrides)  # a sweep: each member's layout
                for values in combinations(axes, getattr(args, "zip", False)) if axes else [{}]:
                    member = [*shared, *(f"{key}={value}" for key, value in values.items())]
                    plan = json.loads(plan_output([args.config, *member, "--json", *world], where))
                    assert plan["fits"], f"{where}: {' '.join(argv)} does not fit ({values})"
            checked += 1
        assert checked, f"{where}: nothing in the block is checked"


def srun_world(launcher: list[str]) -> list[str]:
    """`plan`'s --world for a command srun starts: its nodes x tasks per node (none: the config's own)."""
    flags = dict(word.lstrip("-").split("=", 1) for word in launcher if word.startswith("--") and "=" in word)
    if "nodes" not in flags:
        return []
    return ["--world", str(int(flags["nodes"]) * int(flags.get("ntasks-per-node", 1)))]


@functools.cache
def module_functions(path: Path) -> dict[str, ast.FunctionDef]:
    """A test module's functions at module level, by name: the last definition of a name, as Python binds it."""
    tree = ast.parse(path.read_text())
    return {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}


def always_skipped(fn: ast.FunctionDef) -> bool:
    """A bare `pytest.mark.skip` or `xfail` (no condition), `skipif(True)`, or a `pytest.skip()` its body
    always reaches (a statement of the body itself, not under a condition)."""
    for decorator in fn.decorator_list:
        call = decorator if isinstance(decorator, ast.Call) else None
        mark = ast.unparse(call.func if call else decorator)
        if mark in ("pytest.mark.skip", "pytest.mark.xfail") and not (call and call.args):
            return True
        condition = call.args[0] if call and call.args else None
        if mark == "pytest.mark.skipif" and isinstance(condition, ast.Constant) and condition.value:
            return True
    return any(isinstance(stmt, ast.Expr) and ast.unparse(stmt.value).startswith("pytest.skip(") for stmt in fn.body)


def checks_something(fn: ast.FunctionDef, path: Path, seen: set[str]) -> bool:
    """An assert, or pytest.raises / fail / warns, in `fn` or in a function of its module or of
    tests/conftest.py that it calls or hands on (a rank's checks through `launch_local`), at any depth."""
    for node in ast.walk(fn):
        if isinstance(node, ast.Assert):
            return True
        if isinstance(node, ast.Attribute) and ast.unparse(node) in ("pytest.raises", "pytest.fail", "pytest.warns"):
            return True
    helpers = {**module_functions(ROOT / "tests" / "conftest.py"), **module_functions(path)}
    called = {node.id for node in ast.walk(fn) if isinstance(node, ast.Name) and node.id in helpers} - seen
    seen |= called
    return any(checks_something(helpers[name], path, seen) for name in called)


def named_test_problem(path: Path, name: str) -> str | None:
    """Why pytest would not run `name` of `path` as a check, or None: it must be a function at module level
    that pytest collects (`test_*` in a `test_*.py` file, under testpaths), never skipped whatever holds,
    that checks something (`checks_something`)."""
    fn = module_functions(path).get(name)
    if fn is None or not name.startswith("test") or not path.name.startswith("test_"):
        return "which pytest does not collect (no module-level test function of that name)"
    if always_skipped(fn):
        return "which is always skipped"
    if not checks_something(fn, path, {name}):
        return "which asserts nothing (no assert, pytest.raises or pytest.fail, nor a helper of its module with one)"
    return None


def test_named_tests_and_benchmarks_exist():
    """Every `tests/test_x.py::name` and `tools/x.py` a page names is there, so a claim keeps its test: a
    test pytest collects, runs whatever holds (never skipped unconditionally) and that asserts something."""
    named = 0
    for page in PAGES:
        for test_file, test_name, tool in REFERENCE.findall(page.read_text()):
            path = ROOT / (test_file or tool)
            assert path.is_file(), f"{page.name} names {path.relative_to(ROOT)}, which does not exist"
            if test_name and (problem := named_test_problem(path, test_name)):
                pytest.fail(f"{page.name} names {test_file}::{test_name}, {problem}")
            named += 1
    assert named >= 100


def test_every_page_ends_with_its_tests_and_readme_maps_every_page():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= README_LINES
    for page in PAGES[1:]:
        assert f"(docs/{page.name})" in readme, f"README does not link docs/{page.name}"
        if page in GENERATED:
            continue
        references = page.read_text().split("\n## Tests and benchmarks\n")
        assert len(references) == 2 and REFERENCE.search(references[1]), f"{page.name}: no tests named at its end"


def test_composition_table_is_what_the_checks_say():
    """docs/parallelism.md's table of which feature pairs a run accepts is what `tools/composition.py` prints
    from the checks every command runs, so a refusal added or lifted shows there (refresh: `--write`)."""
    spec = importlib.util.spec_from_file_location("composition", ROOT / "tools" / "composition.py")
    composition = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(composition)
    page = composition.PAGE.read_text()
    assert page == composition.page_with(composition.render(), page), "stale: python tools/composition.py --write"
