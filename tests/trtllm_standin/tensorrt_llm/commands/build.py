"""tensorrt_llm/commands/build.py: parallel_build, build_and_save and build_model as upstream runs them (the same at
65f1d153, before PR #8330, and in the post-#8330 trtllm-build that matches the PR's diff, fork commit 195839a7).
What needs CUDA or TensorRT is replaced: torch.cuda.set_device is recorded, and builder.build returns an engine
that saves a description of the model it was given."""

import copy
import os
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import get_context

from ..builder import build
from ..models import MODEL_MAP


def build_model(build_config, rank=0, ckpt_dir=None, model_config=None, model_cls=None, dry_run=False, **kwargs):
    model_config = copy.deepcopy(model_config)
    architecture = model_config.architecture
    assert rank < model_config.mapping.world_size
    rank_config = copy.deepcopy(model_config)
    rank_config.set_rank(rank)
    if model_cls is None:
        assert architecture in MODEL_MAP, f"Unsupported model architecture: {architecture}"
        model_cls = MODEL_MAP[architecture]
    if ckpt_dir is None:
        model = model_cls(rank_config)
    else:
        model = model_cls.from_checkpoint(ckpt_dir, config=rank_config)
    return build(model, build_config)


def build_and_save(rank, gpu_id, ckpt_dir, build_config, output_dir, log_level, model_config, model_cls, **kwargs):
    engine = build_model(build_config, rank, ckpt_dir, model_config, model_cls=model_cls, **kwargs)
    assert engine is not None
    engine.gpu_id = gpu_id  # upstream: torch.cuda.set_device(gpu_id) first
    engine.save(output_dir)
    return True


def parallel_build(
    model_config, ckpt_dir, build_config, output_dir, workers=1, log_level="info", model_cls=None, **kwargs
):
    world_size = model_config.mapping.world_size
    if workers == 1:
        for rank in range(world_size):
            passed = build_and_save(
                rank, rank % workers, ckpt_dir, build_config, output_dir, log_level, model_config, model_cls, **kwargs
            )
            assert passed, "Engine building failed, please check error log."
    else:
        with ProcessPoolExecutor(mp_context=get_context("spawn"), max_workers=workers) as p:
            futures = [
                p.submit(
                    build_and_save,
                    rank,
                    rank % workers,
                    ckpt_dir,
                    build_config,
                    output_dir,
                    log_level,
                    model_config,
                    model_cls,
                    **kwargs,
                )
                for rank in range(world_size)
            ]
            exceptions = []
            for future in as_completed(futures):
                try:
                    assert future.result(), "Engine building failed, please check error log."
                except Exception as e:
                    exceptions.append(e)
            assert len(exceptions) == 0, "Engine building failed, please check error log."
    os.makedirs(output_dir, exist_ok=True)
