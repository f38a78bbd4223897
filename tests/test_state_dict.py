"""The state-dict gate: native format both ways, exact resume, full validation, async-safe saves, DCP."""

from __future__ import annotations

import copy
import io
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from chunked_offload import MASTER_KEY, ChunkedOffloadOptimizer
from reference import ODD_SHAPES, assert_equal, assert_states_equal, make_params, run_master_reference, run_steps

MAKERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "adamw-fused": lambda ps: torch.optim.AdamW(
        [{"params": ps[:3]}, {"params": ps[3:], "lr": 3e-3}], lr=1e-2, weight_decay=0.1, fused=True
    ),
    "adamw-foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, foreach=True),
    "muon": lambda ps: torch.optim.Muon(ps, lr=1e-2, weight_decay=0.1),
}
SHAPES = {"muon": [(7, 3), (33, 17), (64, 129), (40, 8)]}


def _shapes(name: str) -> list[tuple[int, ...]]:
    return SHAPES.get(name, ODD_SHAPES)


def _roundtrip(sd: dict[str, Any]) -> dict[str, Any]:
    """torch.save, then torch.load(weights_only=True): what a checkpoint file gives back."""
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def _copy_params(dst: list[torch.nn.Parameter], src: list[torch.nn.Parameter]) -> None:
    with torch.no_grad():
        for d, s in zip(dst, src, strict=True):
            d.copy_(s)


@pytest.mark.parametrize("name", list(MAKERS))
@pytest.mark.parametrize("direction", ["wrapper-to-plain", "plain-to-wrapper", "wrapper-to-wrapper"])
def test_resume_matches_uninterrupted_run(name: str, direction: str) -> None:
    make, shapes = MAKERS[name], _shapes(name)
    ref_params = make_params(shapes)
    ref = make(ref_params)
    run_steps(ref, ref_params, 50, none_every=5)

    first_params = make_params(shapes)
    first_wrapped = direction != "plain-to-wrapper"
    first = make(first_params)
    if first_wrapped:
        first = ChunkedOffloadOptimizer(first, chunk_size_mb=0.004)
    run_steps(first, first_params, 20, none_every=5)
    sd = _roundtrip(first.state_dict())

    second_params = make_params(shapes, seed=7)  # different values: the checkpoint and the copy restore them
    _copy_params(second_params, first_params)
    second_wrapped = direction != "wrapper-to-plain"
    second = (
        ChunkedOffloadOptimizer(make(second_params), chunk_size_mb=0.004) if second_wrapped else make(second_params)
    )
    second.load_state_dict(sd)
    run_steps(second, second_params, 30, none_every=5, first_step=20)

    for a, b in zip(ref_params, second_params, strict=True):
        assert_equal(a, b)
    assert_states_equal(ref, ref_params, second, second_params)


def test_state_dict_is_native_and_reads_host_copies() -> None:
    ref_params, params = make_params(ODD_SHAPES), make_params(ODD_SHAPES)
    ref = MAKERS["adamw-fused"](ref_params)
    opt = ChunkedOffloadOptimizer(MAKERS["adamw-fused"](params), chunk_size_mb=0.004)
    run_steps(ref, ref_params, 3)
    run_steps(opt, params, 3)
    got, want = opt.state_dict(), ref.state_dict()
    assert got["param_groups"] == want["param_groups"]
    assert set(got["state"]) == set(want["state"])
    for pid, entry in want["state"].items():
        assert set(got["state"][pid]) == set(entry)
        for k, v in entry.items():
            assert_equal(v, got["state"][pid][k], f"{pid}/{k}")
    got["state"][0]["extra"] = 1  # the returned entries never alias the inner's state dicts
    assert "extra" not in opt.state[params[0]]


def test_load_restores_hyperparameters_and_step_counters() -> None:
    params = make_params(ODD_SHAPES)
    opt = ChunkedOffloadOptimizer(MAKERS["adamw-fused"](params), chunk_size_mb=0.004)
    run_steps(opt, params, 4)
    sd = copy.deepcopy(opt.state_dict())
    sd["param_groups"][0]["lr"] = 0.123
    sd["param_groups"][1]["betas"] = (0.8, 0.9)
    other_params = make_params(ODD_SHAPES)
    other = ChunkedOffloadOptimizer(MAKERS["adamw-fused"](other_params), chunk_size_mb=0.004)
    other.load_state_dict(sd)
    assert other.param_groups[0]["lr"] == 0.123 and other.param_groups[1]["betas"] == (0.8, 0.9)
    assert other.param_groups[0]["params"] == other_params[:3]
    assert all(other.state[p]["step"].item() == 4.0 for p in other_params)


@pytest.mark.parametrize("mode", ["fp32", "remainder"])
def test_masters_resume_exactly_and_plain_loads_ignore_them(mode: str) -> None:
    make = MAKERS["adamw-foreach"]
    ref_params = make_params(ODD_SHAPES, torch.bfloat16)
    masters, ref = run_master_reference(make, ref_params, 30, none_every=4)

    params = make_params(ODD_SHAPES, torch.bfloat16)
    opt = ChunkedOffloadOptimizer(make(params), chunk_size_mb=0.004, master_weights=mode)
    run_steps(opt, params, 12, none_every=4)
    sd = _roundtrip(opt.state_dict())
    assert all(sd["state"][i][MASTER_KEY].dtype == torch.float32 for i in sd["state"])

    # Resume into a wrapper of the other mode: masters travel as fp32 whatever the mode that saved them.
    other_mode = "remainder" if mode == "fp32" else "fp32"
    resumed_params = make_params(ODD_SHAPES, torch.bfloat16, seed=9)
    _copy_params(resumed_params, params)
    resumed = ChunkedOffloadOptimizer(make(resumed_params), chunk_size_mb=0.004, master_weights=other_mode)
    resumed.load_state_dict(sd)
    # The loop below is the reference's remaining 18 steps, from step 12 on.
    run_steps(resumed, resumed_params, 18, none_every=4, first_step=12)
    for a, b in zip(ref_params, resumed_params, strict=True):
        assert_equal(a, b)
    got = dict((id(p), m) for p, m in resumed.master_params())
    for p, m in zip(resumed_params, masters, strict=True):
        assert_equal(m, got[id(p)])

    # A plain optimizer over fp32 copies loads the same checkpoint and ignores the masters key.
    plain = make([torch.nn.Parameter(p.detach().float()) for p in params])
    plain.load_state_dict(sd)


def _state_snapshot(opt: ChunkedOffloadOptimizer) -> tuple[Any, Any]:
    sd = opt.state_dict(snapshot=True)
    return copy.deepcopy(sd["param_groups"]), sd["state"]


def _assert_unchanged(opt: ChunkedOffloadOptimizer, before: tuple[Any, Any]) -> None:
    groups, state = before
    now_groups, now_state = _state_snapshot(opt)
    assert now_groups == groups
    assert set(now_state) == set(state)
    for pid in state:
        for k, v in state[pid].items():
            assert_equal(v, now_state[pid][k], f"{pid}/{k}") if isinstance(v, torch.Tensor) else None


def _bad_checkpoints() -> dict[str, tuple[Callable[[dict[str, Any]], Any], type, str]]:
    def wrong_shape(sd: dict[str, Any]) -> Any:
        sd["state"][2]["exp_avg"] = torch.zeros(17, 33)
        return sd

    def missing_key(sd: dict[str, Any]) -> Any:
        del sd["state"][4]["exp_avg_sq"]
        return sd

    def wrong_dtype(sd: dict[str, Any]) -> Any:
        sd["state"][0]["exp_avg"] = sd["state"][0]["exp_avg"].double()
        return sd

    def extra_group(sd: dict[str, Any]) -> Any:
        sd["param_groups"].append({**sd["param_groups"][0], "params": [99]})
        return sd

    def fewer_groups(sd: dict[str, Any]) -> Any:
        sd["param_groups"] = sd["param_groups"][:1]
        return sd

    def other_model(sd: dict[str, Any]) -> Any:
        other = make_params([(4, 4), (8,)])
        opt = torch.optim.AdamW(other)
        run_steps(opt, other, 1)
        return opt.state_dict()

    def unknown_id(sd: dict[str, Any]) -> Any:
        sd["state"][1234] = sd["state"][0]
        return sd

    def not_a_dict(sd: dict[str, Any]) -> Any:
        return [sd]

    def no_state(sd: dict[str, Any]) -> Any:
        del sd["state"]
        return sd

    return {
        "wrong-shape": (wrong_shape, ValueError, r"param 2 .* state 'exp_avg' has shape \(17, 33\)"),
        "missing-key": (missing_key, ValueError, r"param 4 .* lacks state \['exp_avg_sq'\]"),
        "wrong-dtype": (wrong_dtype, ValueError, r"state 'exp_avg' has dtype torch.float64"),
        "extra-group": (extra_group, ValueError, "has 3 param groups but the optimizer has 2"),
        "fewer-groups": (fewer_groups, ValueError, "has 1 param groups but the optimizer has 2"),
        "other-model": (other_model, ValueError, "has 1 param groups but the optimizer has 2"),
        "unknown-id": (unknown_id, ValueError, r"state for param ids \[1234\]"),
        "not-a-dict": (not_a_dict, TypeError, "must be a mapping"),
        "no-state": (no_state, ValueError, r"lacks \['state'\]"),
    }


@pytest.mark.parametrize("case", list(_bad_checkpoints()))
def test_bad_checkpoints_are_rejected_and_change_nothing(case: str) -> None:
    corrupt, error, match = _bad_checkpoints()[case]
    params = make_params(ODD_SHAPES)
    opt = ChunkedOffloadOptimizer(MAKERS["adamw-fused"](params), chunk_size_mb=0.004)
    run_steps(opt, params, 3)
    before = _state_snapshot(opt)
    bad = corrupt(copy.deepcopy(opt.state_dict()))
    with pytest.raises(error, match=match):
        opt.load_state_dict(bad)
    _assert_unchanged(opt, before)


def test_truncated_checkpoint_file_is_rejected_and_changes_nothing(tmp_path: Path) -> None:
    params = make_params(ODD_SHAPES)
    opt = ChunkedOffloadOptimizer(MAKERS["adamw-fused"](params), chunk_size_mb=0.004)
    run_steps(opt, params, 3)
    path = tmp_path / "opt.pt"
    torch.save(opt.state_dict(), path)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    before = _state_snapshot(opt)
    with pytest.raises((RuntimeError, OSError, EOFError)):  # torch.load itself refuses the file
        opt.load_state_dict(torch.load(path, weights_only=True))
    _assert_unchanged(opt, before)


def test_background_save_of_a_snapshot_is_not_torn_by_later_steps(tmp_path: Path) -> None:
    params = make_params([(256, 256)] * 6)
    opt = ChunkedOffloadOptimizer(MAKERS["adamw-foreach"](params), chunk_size_mb=0.3)
    run_steps(opt, params, 3)
    expected = {pid: {k: v.clone() for k, v in e.items()} for pid, e in opt.state_dict()["state"].items()}
    sd = opt.state_dict(snapshot=True)
    path = tmp_path / "ckpt.pt"
    writer = threading.Thread(target=torch.save, args=(sd, path))
    writer.start()
    run_steps(opt, params, 5, first_step=3)  # write back into the same host buffers while the save runs
    writer.join()
    saved = torch.load(path, weights_only=True)["state"]
    for pid, entry in expected.items():
        for k, v in entry.items():
            assert_equal(v, saved[pid][k], f"{pid}/{k}")
    assert not torch.equal(opt.state[params[0]]["exp_avg"], expected[0]["exp_avg"])  # training moved on


def test_dcp_async_save_while_training_continues(tmp_path: Path) -> None:
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    params = make_params([(256, 256)] * 6)
    opt = ChunkedOffloadOptimizer(MAKERS["adamw-foreach"](params), chunk_size_mb=0.3)
    run_steps(opt, params, 3)
    expected = {pid: {k: v.clone() for k, v in e.items()} for pid, e in opt.state_dict()["state"].items()}
    with _gloo(tmp_path):
        future = dcp.async_save({"optim": opt.state_dict()}, checkpoint_id=str(tmp_path / "dcp"))
        run_steps(opt, params, 5, first_step=3)
        future.result()
        template = {"optim": copy.deepcopy(opt.state_dict(snapshot=True))}
        dcp.load(template, checkpoint_id=str(tmp_path / "dcp"))
    for pid, entry in expected.items():
        for k, v in entry.items():
            assert_equal(v, template["optim"]["state"][pid][k], f"{pid}/{k}")


def test_dcp_optimizer_state_dict_roundtrip(tmp_path: Path) -> None:
    dcp = pytest.importorskip("torch.distributed.checkpoint")
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    def model_and_opt(seed: int, mode: str) -> tuple[torch.nn.Module, ChunkedOffloadOptimizer]:
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(16, 33), torch.nn.ReLU(), torch.nn.Linear(33, 5)).to(torch.bfloat16)
        inner = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
        return model, ChunkedOffloadOptimizer(inner, chunk_size_mb=0.002, master_weights=mode)

    def train(model: torch.nn.Module, opt: ChunkedOffloadOptimizer, steps: int, first: int) -> None:
        for step in range(first, first + steps):
            gen = torch.Generator().manual_seed(step)
            model(torch.randn(8, 16, generator=gen).to(torch.bfloat16)).float().square().mean().backward()
            opt.step()
            opt.zero_grad()

    ref_model, ref_opt = model_and_opt(0, "fp32")
    train(ref_model, ref_opt, 10, 0)

    model, opt = model_and_opt(0, "fp32")
    train(model, opt, 4, 0)
    with _gloo(tmp_path):
        osd = get_optimizer_state_dict(model, opt)
        dcp.save({"optim": osd, "model": model.state_dict()}, checkpoint_id=str(tmp_path / "dcp"))

        new_model, new_opt = model_and_opt(1, "remainder")
        target = {"optim": get_optimizer_state_dict(new_model, new_opt), "model": new_model.state_dict()}
        dcp.load(target, checkpoint_id=str(tmp_path / "dcp"))
        new_model.load_state_dict(target["model"])
        set_optimizer_state_dict(new_model, new_opt, target["optim"])
    train(new_model, new_opt, 6, 4)
    for a, b in zip(ref_model.parameters(), new_model.parameters(), strict=True):
        assert_equal(a, b)
    ref_masters, new_masters = list(ref_opt.master_params()), list(new_opt.master_params())
    for (_, a), (_, b) in zip(ref_masters, new_masters, strict=True):
        assert_equal(a, b)


class _gloo:
    """A one-process gloo group for torch.distributed.checkpoint."""

    def __init__(self, tmp_path: Path) -> None:
        self.store = tmp_path / "store"

    def __enter__(self) -> None:
        import torch.distributed as dist

        dist.init_process_group("gloo", init_method=f"file://{self.store}", rank=0, world_size=1)

    def __exit__(self, *exc: object) -> None:
        import torch.distributed as dist

        dist.destroy_process_group()
