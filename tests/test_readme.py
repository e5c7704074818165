"""The README and docs/ against what they document: the README's two set-up commands are the ones `.ci/run`
runs, word for word; its quick-start example runs (on CPU) and prints what the README says it prints;
docs/ops.md gives the schema of every registered moe_ext op as registered; the links of the README and
docs/ point at files and headings that exist, and none of them points outside the repo."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import moe_extension  # noqa: F401  (registers the ops)

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
# The quick start's MXFP4 call differs from the call on its dequantized weights only by the bf16 rounding of
# the second GEMM's input (a few bf16 ulps of outputs of magnitude ~1); a wrong decode is off by ~0.2 and more.
MXFP4_BOUND = 0.02


def section(text: str, heading: str) -> str:
    """The body of the ``## heading`` section (up to the next ``## ``)."""
    match = re.search(rf"^## {re.escape(heading)}\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert match, f"README.md has no '## {heading}' section"
    return match.group(1)


def code_blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```$", text, re.S | re.M)


def setup_commands() -> dict[str, str]:
    """The README's set-up commands by what they end with: the main job and the tests."""
    blocks = code_blocks(section(README.read_text(), "Set up on a fresh machine"), "bash")
    commands = [line.strip() for block in blocks for line in block.splitlines() if line.strip()]
    found = {}
    for tail in ("python -m moe_extension", "python -m pytest"):
        matching = [c for c in commands if c.endswith(tail)]
        assert len(matching) == 1, f"want one set-up command ending in {tail!r}, got {matching}"
        found[tail] = matching[0]
    return found


def test_ci_runs_the_readme_setup_commands_word_for_word():
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    for tail, command in setup_commands().items():
        assert command.startswith("python -m pip install "), command
        assert command in ci_lines, f".ci/run does not run the README's command ending in {tail!r}:\n{command}"
    assert any(line.startswith("python3 -m venv ") for line in ci_lines), ".ci/run must make a fresh virtualenv"


def _numbers(line: str) -> tuple[str, list[str]]:
    """``line`` with each number replaced by ``#``, and the numbers."""
    pattern = r"-?\d+(?:\.\d+)?(?:e-?\d+)?"
    return re.sub(pattern, "#", line), re.findall(pattern, line)


def test_quick_start_runs_and_prints_what_the_readme_says():
    quick = section(README.read_text(), "Quick start")
    (code,) = code_blocks(quick, "python")
    (shown,) = code_blocks(quick, "text")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    got, want = result.stdout.splitlines(), shown.splitlines()
    assert len(got) == len(want), f"printed:\n{result.stdout}\nREADME shows:\n{shown}"
    for got_line, want_line in zip(got, want):
        if "max abs diff" not in want_line:
            assert got_line == want_line
            continue
        # The one float: rounding may differ by an ulp between CPUs, so both values only have to be in bound.
        (got_shape, got_nums), (want_shape, want_nums) = _numbers(got_line), _numbers(want_line)
        assert got_shape == want_shape, (got_line, want_line)
        assert float(got_nums[-1]) <= MXFP4_BOUND, f"MXFP4 result off its dequantized weights: {got_line}"
        assert float(want_nums[-1]) <= MXFP4_BOUND, f"the README shows an out-of-bound value: {want_line}"


def test_ops_md_gives_every_registered_schema():
    """Each op under torch.ops.moe_ext has its schema in docs/ops.md, equal to the registered one."""
    text = (ROOT / "docs" / "ops.md").read_text()
    names = sorted(n.split("::")[1] for n in torch._C._dispatch_get_all_op_names() if n.startswith("moe_ext::"))
    assert len(names) >= 11, names
    for name in names:
        documented = re.findall(rf"(?:moe_ext::)?\b{name}\(Tensor[^`\n]*?\) -> [^`\n|]+", text)
        assert documented, f"docs/ops.md has no schema of moe_ext::{name}"
        registered = str(getattr(torch.ops.moe_ext, name).default._schema)
        for schema in documented:
            parsed = torch._C.parse_schema(schema.strip() if "::" in schema else f"moe_ext::{schema.strip()}")
            assert str(parsed) == registered, f"docs/ops.md: {schema}\nregistered: {registered}"


def _slug(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


DOCS = [README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "results" / "README.md"]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_resolve_inside_the_repo(doc):
    text = doc.read_text()
    for outside in ("DESIGN.md", "shared folder", "../shared"):
        assert outside not in text, f"{doc.name} refers to {outside!r}, which is not in the repo"
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if target.startswith(("http://", "https://")):
            continue
        path, _, anchor = target.partition("#")
        file = (doc.parent / path).resolve() if path else doc
        assert file.is_file() and file.is_relative_to(ROOT), f"{doc.name}: broken link {target}"
        if anchor and file.suffix == ".md":
            headings = re.findall(r"^#+ (.+)$", file.read_text(), re.M)
            assert anchor in {_slug(h) for h in headings}, f"{doc.name}: no heading for #{anchor} in {path}"
