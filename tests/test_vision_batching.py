"""The vision_encoder's run planning: the cost-based planner of the portable graph, the cost fit, and
a real VisionBatching over a tiny export giving the same prompt tables however its runs are cut."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import random_pixels
from qwen3vl_trt.serving import interface
from qwen3vl_trt.serving.stages.vision_batching import ALONE, RunCost, VisionBatching, plan_runs_by_cost
from qwen3vl_trt.vision.export import export_vision
from qwen3vl_trt.vision.metadata import vision_metadata
from qwen3vl_trt.vision.onnx_runner import VisionSidecar

# Joining pays while 2 * 5e-9 * run * image <= 1e-3, i.e. run * image <= 100_000 patches^2.
COST = RunCost(fixed_s=1e-3, per_patch_s=1e-5, per_pair_s=5e-9)
NO_LIMIT = 10**9


def _check_partition(runs: list[list[int]], count: int) -> None:
    assert sorted(i for run in runs for i in run) == list(range(count)), "every image in exactly one run"
    assert all(run == sorted(run) for run in runs), "a run keeps its images in batch order"
    assert [run[0] for run in runs] == sorted(run[0] for run in runs), "runs come in the order of their first images"


def test_large_images_never_share_a_run():
    assert plan_runs_by_cost([1200, 1200, 1200, 1200], COST, NO_LIMIT) == [[0], [1], [2], [3]]


def test_small_images_share_runs_and_large_ones_between_them_run_alone():
    patches = [256, 1200, 256, 256, 1200, 256]
    # 256 * 256 pays (<= 100_000), 512 * 256 does not; a 1200-patch image joins no run.
    assert plan_runs_by_cost(patches, COST, NO_LIMIT) == [[0, 2], [1], [3, 5], [4]]


def test_the_memory_limit_cuts_runs_that_would_pay():
    free = RunCost(fixed_s=1.0, per_patch_s=0.0, per_pair_s=0.0)  # joining always pays
    assert plan_runs_by_cost([100] * 5, free, 250) == [[0, 1], [2, 3], [4]]
    assert plan_runs_by_cost([300, 100], free, 250) == [[0], [1]]  # over the limit alone: runs alone
    assert plan_runs_by_cost([], free, 250) == []


def test_before_a_cost_is_measured_every_image_runs_alone():
    assert plan_runs_by_cost([4, 4, 16], ALONE, NO_LIMIT) == [[0], [1], [2]]


@pytest.mark.parametrize("seed", range(20))
def test_no_run_costs_more_than_its_images_apart(seed):
    rng = np.random.default_rng(seed)
    patches = [int(n) for n in rng.choice([4, 16, 64, 256, 1024, 4096], size=int(rng.integers(1, 12)))]
    cost = RunCost(*(float(c) for c in rng.uniform(0, 1, 3) * [1e-3, 1e-5, 1e-8]))
    limit = int(rng.integers(1000, 20000))
    runs = plan_runs_by_cost(patches, cost, limit)
    _check_partition(runs, len(patches))
    for run in runs:
        sizes = [patches[i] for i in run]
        assert len(run) == 1 or sum(sizes) <= limit
        assert cost.seconds(sum(sizes)) <= sum(cost.seconds(n) for n in sizes) * (1 + 1e-12)


def test_the_fit_recovers_a_cost_and_keeps_every_term_non_negative():
    true = RunCost(fixed_s=2e-4, per_patch_s=1.5e-5, per_pair_s=6e-8)
    sizes = [4, 16, 64, 256, 1024]
    fitted = RunCost.fit(sizes, [true.seconds(n) for n in sizes])
    assert fitted.fixed_s == pytest.approx(true.fixed_s, rel=1e-6)
    assert fitted.per_patch_s == pytest.approx(true.per_patch_s, rel=1e-6)
    assert fitted.per_pair_s == pytest.approx(true.per_pair_s, rel=1e-6)
    # Times that fall with size would fit a negative term: the fit leaves it out instead.
    flat = RunCost.fit([4, 16, 64], [1e-3, 0.9e-3, 0.8e-3])
    assert min(flat.fixed_s, flat.per_patch_s, flat.per_pair_s) >= 0


@pytest.fixture(scope="module")
def dense_vision(checkpoints, tmp_path_factory):
    return export_vision(
        checkpoints["dense"], tmp_path_factory.mktemp("vision") / "dense", dtype="fp32", log=lambda *_: None
    )


def _request(grids: list[list[int]], merge: int, side: int, seed: int) -> dict[str, np.ndarray]:
    """The vision_encoder's inputs for a request with these image grids (none: text only)."""
    grid = np.array(grids, np.int64).reshape(-1, 3)
    if grids:
        inputs = dict(vision_metadata(grid, merge, side))
        inputs[interface.VISION_PIXELS.name] = random_pixels(grid, seed=seed)
    else:
        inputs = {
            interface.VISION_PIXELS.name: np.zeros((0, 1536), np.float32),
            interface.VISION_POS_EMBED_IDX.name: np.zeros((0, 4), np.int32),
            interface.VISION_POS_EMBED_W.name: np.zeros((0, 4), np.float32),
            interface.VISION_ROTARY_POS.name: np.zeros((0, 2), np.int32),
            interface.VISION_SEGMENT_START.name: np.zeros((0,), np.int32),
        }
    inputs[interface.IMAGE_GRID_THW.name] = grid
    inputs[interface.VISUAL_TOKEN_COUNT.name] = np.array([int(grid.prod(axis=1).sum()) // merge**2], np.int32)
    return inputs


def test_prompt_tables_are_the_same_however_the_runs_are_cut(dense_vision):
    vision_dir = dense_vision.output_dir
    joined = RunCost(fixed_s=1.0, per_patch_s=0.0, per_pair_s=0.0)

    def batching(cost: RunCost | None, budget: int = 1 << 30) -> tuple[VisionBatching, list[tuple[int, int]]]:
        runs: list[tuple[int, int]] = []
        made = VisionBatching(
            vision_dir, torch.float32, 1, budget, run_cost=cost, on_run=lambda i, p, _s: runs.append((i, p))
        )
        return made, runs

    probe, _ = batching(ALONE)
    merge, side = probe.merge, probe.num_grid_per_side
    requests = [
        _request([[1, 8, 8]], merge, side, seed=0),
        _request([[1, 4, 4], [1, 8, 12]], merge, side, seed=1),
        _request([], merge, side, seed=2),
        _request([[2, 6, 4]], merge, side, seed=3),  # two temporal patches: two attention segments
        _request([[1, 4, 8]], merge, side, seed=4),
    ]
    patches = [64, 16, 96, 48, 32]
    # Three fp32 [heads 2, N, N] tensors: 100 patches fit, 112 do not.
    budgets = {"one run": (joined, 1 << 30), "each alone": (ALONE, 1 << 30), "cut at 100 patches": (joined, 240_000)}
    tables = {}
    for name, (cost, budget) in budgets.items():
        made, runs = batching(cost, budget)
        tables[name] = [out[interface.PROMPT_TABLE.name] for out in made.execute(requests)]
        assert sum(p for _, p in runs) == sum(patches) and sum(i for i, _ in runs) == len(patches), name
        if name == "one run":
            assert runs == [(5, sum(patches))]
        elif name == "each alone":
            assert runs == [(1, 64), (1, 16), (1, 96), (1, 48), (1, 32)]
        else:
            assert len(runs) > 1 and all(p <= 100 for i, p in runs if i > 1), runs

    measured, _ = batching(None)
    measured.warm_up()
    assert measured.run_cost is not None and measured.run_cost.per_pair_s >= 0
    tables["measured cost"] = [out[interface.PROMPT_TABLE.name] for out in measured.execute(requests)]

    reference = tables.pop("each alone")
    rows_per_token = 1 + int(VisionSidecar.load(vision_dir).raw["deepstack_count"])
    assert [t.shape[0] for t in reference] == [
        16 * rows_per_token,
        28 * rows_per_token,
        1,
        12 * rows_per_token,
        8 * rows_per_token,
    ]
    for name, ours in tables.items():
        for r, (got, want) in enumerate(zip(ours, reference, strict=True)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=f"{name}, request {r}")
