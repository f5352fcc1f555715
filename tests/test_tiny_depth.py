"""The tiny checkpoints have decoder layers past the DeepStack ones, so every comparison with
transformers also covers layers that must receive no visual feature."""

from __future__ import annotations

import pytest
from qwen3vl_trt.hf.checkpoint import Checkpoint


@pytest.mark.parametrize("name", ["dense", "moe"])
def test_tiny_text_models_have_layers_past_the_deepstack(checkpoints, name):
    info = Checkpoint(checkpoints[name]).info
    assert info.deepstack_count == 3  # as the released models
    assert info.text.num_hidden_layers >= info.deepstack_count + 2
