"""README.md and docs/usage.md as tests: every ```python block runs, in the order written
(one namespace per page), the set-up commands are the ones CI runs, and the README's demo
table is what the demo prints."""
import pathlib
import re
import shlex

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = ("README.md", "docs/usage.md")


def _blocks(page, lang):
    text = (ROOT / page).read_text(encoding="utf-8")
    return re.findall(rf"^```{lang}\n(.*?)^```", text, flags=re.S | re.M)


@pytest.mark.parametrize("page", PAGES)
def test_python_snippets_run_in_order(page, tmp_path, monkeypatch):
    pytest.importorskip("flax")
    pytest.importorskip("safetensors")
    blocks = _blocks(page, "python")
    assert blocks, f"{page} has no python block"
    monkeypatch.chdir(tmp_path)  # snippets may write files (checkpoints)
    ns = {"__name__": f"snippets_of_{page}"}
    for i, code in enumerate(blocks):
        exec(compile(code, f"{page} python block {i + 1}", "exec"), ns)


def _test_command(lines):
    return [ln for ln in lines if ln.strip().startswith("python3 -m pytest")]


def test_readme_commands_are_ci_commands():
    readme = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    ci = (ROOT / ".ci/run").read_text(encoding="utf-8").splitlines()
    cmd = _test_command(readme)
    assert len(cmd) == 1, f"README.md must hold exactly one test command, has {cmd}"
    assert _test_command(ci) == cmd
    n = readme.index(cmd[0])
    assert n < 40, "the test command must be on the README's first screen"
    # the install line just before it installs what CI installs
    install = readme[n - 1]
    ci_pip = [shlex.split(ln.split("#")[0]) for ln in ci
              if ln.startswith("python3 -m pip install")]
    want = [[a for a in c[c.index("install") + 1:] if a != "-q"] for c in ci_pip]
    got = [shlex.split(part)[2:] for part in install.split("&&")]
    assert got == want
    first = [ln for ln in readme[:n] if ln.startswith("pip install")]
    assert first and first[0] == "pip install -e ."
    assert "JAX_FP4_CUDA=OFF" in "\n".join(readme[:n])


def _readme_demo_rows():
    rows = {}
    for ln in (ROOT / "README.md").read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in ln.strip().strip("|").split("|")]
        if len(cells) == 9 and re.fullmatch(r"\d\.\d{4}", cells[4]):
            rows[(cells[0], cells[1])] = cells[2:8]  # the deterministic columns
    return rows


def test_readme_demo_table_is_what_the_demo_prints():
    """The quality columns of the README's demo rows float32 and nvfp4:nvfp4 (whose
    numbers had drifted from the demo's) are the demo's output on all the packaged
    sentences: sizes digit for digit; the scores to within what XLA's float32 summation
    order on another CPU moves them (1e-3 for the cosines and Spearman, 0.01 for top-1:
    with quantized activations a moved float can flip an activation's rounding)."""
    pytest.importorskip("flax")
    pytest.importorskip("tokenizers")
    from jax_fp4.models import demo, minilm

    try:
        minilm.default_model_dir()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    rows = _readme_demo_rows()
    assert len(rows) == 1 + len(demo.RTN_VARIANTS)
    res = demo.run_demo(variants=["nvfp4:nvfp4"], progress=False)
    printed = {}
    for ln in demo.format_table(res).splitlines()[2:]:
        cells = [c.strip() for c in ln.strip().strip("|").split("|")]
        printed[(cells[0], cells[1])] = cells[2:8]
    assert set(printed) <= set(rows)
    for key, cells in printed.items():
        assert rows[key][:2] == cells[:2], key
        tol = [1e-3, 1e-3, 1e-3, 1e-2]
        assert all(abs(float(a) - float(b)) <= t + 1e-9
                   for a, b, t in zip(rows[key][2:], cells[2:], tol)), (key, rows[key], cells)
