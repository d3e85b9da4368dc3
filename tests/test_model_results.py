"""benchmarks/model_results.py reads the model benchmark's rows from its JSON and from the
Markdown tables in RESULTS.md (the GPU speed notebook plots them); both agree."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import bench_model  # noqa: E402
import model_results  # noqa: E402


def test_json_and_markdown_rows_agree(tmp_path):
    md, js = tmp_path / "RESULTS.md", tmp_path / "rows.json"
    bench_model.main(["--tiny", "--ms", "4", "8", "--iters", "2", "--formats", "int4",
                      "--no-kernel-sum", "--results", str(md), "--json", str(js)])
    a, b = model_results.load(js), model_results.load(md)
    assert [(r["m"], r["fmt"]) for r in a] == [(4, "int4"), (8, "int4")]
    assert [(r["m"], r["fmt"], round(r["ratio"], 2)) for r in a] == \
        [(r["m"], r["fmt"], r["ratio"]) for r in b]
    assert all(abs(x["bf16_ms"] - y["bf16_ms"]) < 1e-3 for x, y in zip(a, b))
    assert [round(r["loop_ratio"], 2) for r in a] == [r["loop_ratio"] for r in b]
    assert all(abs(x["bf16_loop_ms"] - y["bf16_loop_ms"]) < 1e-3 for x, y in zip(a, b))


def test_recorded_results_parse():
    rows = model_results.load()
    gpus = {r["gpu"] for r in rows}
    assert {"H100", "H200"} <= gpus
    h100 = {(r["m"], r["fmt"]): r["ratio"] for r in rows if r["table"].startswith("A. H100")}
    assert h100[(1, "nvfp4")] > 1 and (1024, "mxfp4") not in h100  # "-": not measured
    assert all(r["ratio"] > 0 and r["m"] >= 1 for r in rows)
    # tables with a decode loop give both ratios; older ones the blocked one alone
    i = {(r["m"], r["fmt"]): r for r in rows if r["table"].startswith("I. H100")}
    assert (i[(1, "nvfp4")]["ratio"], i[(1, "nvfp4")]["loop_ratio"]) == (1.14, 1.89)
    assert all(r["loop_ratio"] is None for r in rows if r["table"].startswith("A. H100"))
