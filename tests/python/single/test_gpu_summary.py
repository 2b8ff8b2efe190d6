"""scripts/gpu/summary.py joins the GPU benchmark's JSON lines into one table per np; gossip
records carry no byte count and must not stop it."""
import importlib.util
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "..", "..", "..", "scripts", "gpu", "summary.py")


def summary_module():
    spec = importlib.util.spec_from_file_location("gpu_summary", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def report_lines(tmp_path, records):
    """summary.py's report of `records` written as its JSON lines, line by line."""
    path = tmp_path / "bench.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    mod = summary_module()
    return mod.report(mod.load(str(path))).splitlines()


def test_one_table_per_np_with_gossip_records(tmp_path):
    mib256 = 256 << 20
    records = [
        {"kind": "sweep", "np": 2, "bytes": mib256, "ferrovod_s": 0.004, "nccl_s": 0.0038},
        {"kind": "sweep", "np": 2, "bytes": mib256, "torch_s": 0.005},
        {"kind": "sweep", "np": 4, "bytes": mib256, "ferrovod_s": 0.006, "nccl_s": 0.006},
        {"kind": "sweep", "np": 4, "bytes": mib256, "torch_s": 0.0054},
        {"kind": "resnet50", "np": 4, "tensors": 161, "bytes": 102228128,
         "ferrovod_s": 652e-6, "nccl_s": 495e-6},
        {"kind": "resnet50", "np": 4, "bytes": 102228128, "torch_s": 569e-6},
        {"kind": "resnet50_gossip", "np": 4, "ferrovod_s": 1059e-6, "nccl_sendrecv_s": 900e-6,
         "ferrovod_allreduce_s": 652e-6},
    ]
    lines = report_lines(tmp_path, records)
    assert lines.count("# np=2") == 1 and lines.count("# np=4") == 1
    # busbw ratios: the same bytes, so ferrovod/torch is the inverse ratio of the times
    assert f"gpu np=2 256MiB busbw ferrovod/torch = {0.005 / 0.004:.3f}" in lines
    assert f"gpu np=4 256MiB busbw ferrovod/torch = {0.0054 / 0.006:.3f}" in lines
    assert f"gpu np=4 resnet50 ferrovod/one-allreduce = {652 / 495:.3f}" in lines
    assert f"gpu np=4 resnet50 gossip/allreduce = {1059 / 652:.3f}" in lines
    # the np 4 table holds its own sweep row and not np 2's
    np4 = lines[lines.index("# np=4"):]
    assert any(line.split()[:1] == [str(mib256)] for line in np4)
    np2 = lines[lines.index("# np=2"):lines.index("# np=4")]
    assert sum(1 for line in np2 if line.split()[:1] == [str(mib256)]) == 1


def test_the_single_tensor_figure_beside_the_back_to_back_one(tmp_path):
    mib256 = 256 << 20
    records = [
        {"kind": "sweep", "np": 2, "bytes": mib256, "ferrovod_s": 0.004, "nccl_s": 0.0038},
        {"kind": "sweep", "np": 2, "bytes": mib256, "torch_s": 0.005},
        {"kind": "single", "np": 2, "bytes": mib256, "ferrovod_s": 0.0052, "nccl_s": 0.0049},
        {"kind": "single", "np": 2, "bytes": mib256, "torch_s": 0.005},
    ]
    lines = report_lines(tmp_path, records)
    assert f"gpu np=2 256MiB busbw ferrovod/torch = {0.005 / 0.004:.3f}" in lines
    assert f"gpu np=2 256MiB single-tensor busbw ferrovod/torch = {0.005 / 0.0052:.3f}" in lines
    # the single record is not a sweep row of its own
    assert sum(1 for line in lines if line.split()[:1] == [str(mib256)]) == 1


def test_targets_judge_each_line_by_its_goal():
    spec = importlib.util.spec_from_file_location(
        "gpu_targets", os.path.join(os.path.dirname(SCRIPT), "targets.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    lines = [
        "# a header",
        "gpu np=4 resnet50 ferrovod/one-allreduce = 1.225",
        "gpu np=2 resnet50 ferrovod/one-allreduce = 1.049",
        "gpu np=2 256MiB busbw ferrovod/torch = 0.969",
        "gpu np=4 resnet50-train ferrovod/no-comm = 0.980 (bf16)",
        "gpu np=4 bert-base-train ferrovod/ddp = 0.999",
        "gpu np=2 resnet50-train ddp-ferrovod/ddp-nccl = 1.002",
        "gpu np=2 fsdp-train ferrovod/nccl = 0.912 (bf16) (throughput) [device wait]",
        "gpu np=1 fsdp-train ferrovod/nccl = 1.018 (throughput)",
        "gpu np=2 resnet50-train ferrovod/ferrovod-per-gradient = 1.100",
        "gpu np=4 256MiB single-tensor busbw ferrovod/torch = nan",
    ]
    got = [v.split()[0] for _, v in mod.check(lines)]
    assert got == ["MISSED", "met", "MISSED", "met", "MISSED", "met", "MISSED", "(np", "(no",
                   "MISSED"]
    # a tag and the precision stay on the line
    assert mod.check(lines[7:8])[0][0].endswith("(bf16) (throughput) [device wait]")
