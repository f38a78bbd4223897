"""``import chunked_offload`` costs little over ``import torch`` and imports neither dynamo nor torch.distributed:
both come in when a wrapper is built or FSDP2 is used ([Note: Opaque to dynamo]). Nor Megatron, even with its
integration module imported: it comes in when ``wrap_megatron_optimizer`` runs."""

from __future__ import annotations

import json
import subprocess
import sys

_PROBE = """
import json, sys, time
start = time.perf_counter()
import torch
after_torch = time.perf_counter()
before = set(sys.modules)
import chunked_offload
import chunked_offload.integrations.megatron
done = time.perf_counter()
prefixes = ("torch._dynamo", "torch.distributed", "triton", "megatron")
new = sorted(m for m in set(sys.modules) - before if m.startswith(prefixes))
print(json.dumps({"seconds": done - after_torch, "new": new}))
"""


def _probe() -> dict[str, object]:
    out = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_import_adds_no_dynamo_or_distributed_module_and_at_most_0_3_s_over_torch() -> None:
    runs = [_probe() for _ in range(3)]  # the fastest of three: a loaded machine slows any one run
    assert runs[0]["new"] == [], runs[0]["new"]
    assert min(float(r["seconds"]) for r in runs) <= 0.3, runs  # type: ignore[arg-type]


def test_a_wrapper_works_in_a_process_that_imported_nothing_else() -> None:
    code = (
        "import torch\nfrom chunked_offload import ChunkedOffloadOptimizer\n"
        "m = torch.nn.Linear(4, 2)\nopt = ChunkedOffloadOptimizer(torch.optim.AdamW(m.parameters()), overlap=True)\n"
        "opt.attach(m)\nfor _ in range(3):\n    m(torch.randn(3, 4)).sum().backward(); opt.step(); opt.zero_grad()\n"
        "opt.wait_step(); print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().endswith("ok")
