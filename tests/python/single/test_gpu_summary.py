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
    path = tmp_path / "bench.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    mod = summary_module()
    text = mod.report(mod.load(str(path)))
    lines = text.splitlines()
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
